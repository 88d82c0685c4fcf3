import pytest


@pytest.fixture(scope="session")
def demo_assets():
    """The embedded demo (tokenizer, data, SFT policy, PRM, critic), built once and cached
    under the repo's assets/ (``make test`` builds them before pytest starts)."""
    from megarl.demo.assets import build_all

    return build_all()
