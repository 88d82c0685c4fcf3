"""The embedded default demo: a synthetic arithmetic task, a tiny tokenizer, an SFT-warm-started
policy, a critic and a PRM, built by the project's own code (``python -m megarl.demo.assets``)
and addressed as ``embedded://...`` (see ``megarl.demo.assets``)."""

from megarl.demo.assets import assets_root, build_all, ensure, is_built, resolve_uri
from megarl.demo.recipe import ASSETS_VERSION, BuildConfig

__all__ = ["ASSETS_VERSION", "BuildConfig", "assets_root", "build_all", "ensure", "is_built",
           "resolve_uri"]
