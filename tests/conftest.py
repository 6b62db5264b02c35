import os

import pytest
import torch

# A gac compiler error is a test failure, never a silent eager fallback (frontends/fx.py).
os.environ.setdefault("GAC_STRICT_INTERNAL", "1")

# The suite tests compilation: no on-disk cache unless a test turns it on (tests/test_cache.py),
# or the run asks for it (GAC_CACHE=1 in the environment).
os.environ.setdefault("GAC_CACHE", "0")

# Exact float32 convolutions unless a test asks for TF32: eager cuDNN and gac (which follows
# torch.backends.cudnn.allow_tf32, True by default) would otherwise use TF32 and miss f32 tolerances.
torch.backends.cudnn.allow_tf32 = False


def pytest_ignore_collect(collection_path, config):
    """`pytest -m unit` (the fast tier) skips importing test files that hold no unit test:
    importing every module would cost more than the tier's tests themselves."""
    if (config.getoption("markexpr", "") == "unit" and collection_path.suffix == ".py"
            and collection_path.name.startswith("test_")):
        return "mark.unit" not in collection_path.read_text()
    return None


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    has_simx = bool(os.environ.get("VORTEX_HOME"))
    for item in items:
        if "cuda" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs an NVIDIA GPU"))
        if "simx" in item.keywords and not has_simx:
            item.add_marker(pytest.mark.skip(reason="needs VORTEX_HOME (a SimX build)"))


TARGETS = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
