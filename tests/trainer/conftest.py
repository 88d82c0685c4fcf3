import pytest


@pytest.fixture(scope="session")
def demo_assets():
    """The embedded demo (tokenizer, data, SFT policy, PRM, critic), built once and cached
    under the repo's assets/ (``make test`` builds them before pytest starts, with 2 threads
    as ``make demo`` does: the SFT result depends on the thread count)."""
    from megarl.demo.assets import build_all

    return build_all()
