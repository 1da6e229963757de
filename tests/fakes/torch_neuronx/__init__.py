"""Stand-in for torch-neuronx (tests only): registers a fake ``neuron`` backend and device."""

from aotbuild_standin import make_backend, make_namespace

__version__ = "0.0.0+standin"
stats = {"compiles": 0, "loads": 0}
calls: list = []
backend = make_backend("neuron", "TORCH_NEURONX_NEFF_CACHE_DIR", "neff", stats)
namespace = make_namespace("neuron", calls)
