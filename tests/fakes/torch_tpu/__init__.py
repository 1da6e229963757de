"""Stand-in for TorchTPU (tests only): registers a fake ``tpu`` backend and device."""

from aotbuild_standin import make_backend, make_namespace

__version__ = "0.0.0+standin"
stats = {"compiles": 0, "loads": 0}
calls: list = []
backend = make_backend("tpu", "TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT", "bin", stats)
namespace = make_namespace("tpu", calls)
