"""Tensor parallelism (recipe ``parallel.tensor: N``): one process per rank, each holding one shard.

A job of a tensor-parallel recipe is N entries, one per rank: the ranks' compiled graphs differ (each
holds its shard's sizes and its collectives), so each rank's entry has its own key, and the build,
the proof and ``push``/``pull`` handle the N of them together.

* **Sharding.** The component's own ``_tp_plan`` (diffusers: Flux, Flux2, QwenImage). On CPU, where
  diffusers refuses tensor parallelism (its policy: CUDA, Neuron, TPU, XPU), the plan is applied
  exactly as diffusers' ``apply_tensor_parallel`` does on those devices: ``_resolve_tp_plan`` (one
  plan per block), ``resolve_tp_shard_specs`` (every split even, checked before any weight moves),
  ``parallelize_module(block, mesh, _styles(plan))`` ("colwise"/"rowwise" become torch's
  ``ColwiseParallel``/``RowwiseParallel``; diffusers' packed styles stay its own). Those three are
  private helpers of ``diffusers.hooks.tensor_parallel`` (diffusers >= 0.42, checked when a recipe is
  planned). Elsewhere, diffusers' public ``ModelMixin.enable_parallelism(config=TensorParallelConfig(
  mesh=mesh))``, each rank on its ``LOCAL_RANK`` device.
* **Processes.** ``aotbuild build`` starts the ranks itself with torch's launcher (``python -m
  torch.distributed.run --standalone --nproc-per-node N``); a server starts them with ``torchrun``
  and ``load_compiled`` joins the default process group (or uses the caller's). Backend: gloo on
  CPU, nccl on CUDA, torch's default for the device elsewhere.
* **Threads.** torchrun gives every rank ``OMP_NUM_THREADS=1``, which would leave a rank one core. So
  every rank runs :func:`rank_threads` threads (the CPUs this process may use, divided by N), set by
  :func:`setup` in build, proof and serving ranks alike. Entries serve any count (issue 36); only CPU
  kernels without ``cpp.dynamic_threads`` bake it in, and for those the plan keys a rank's count.
* **Keys.** ``parallel: {tensor, mesh, backend, plan, rank}``: the degree, the mesh shape, the
  collective backend, the sha256 of the ``_tp_plan``, the rank. Never a host, a port or a process
  group's name. Present only for N > 1: unsharded recipes keep their keys.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from aotbuild.errors import UsageError
from aotbuild.features.base import Feature, Where

__all__ = ["RANK_VARIABLES", "backend_for", "check_component", "factors", "launched", "plan_digest", "rank_threads",
           "setup", "shard", "tp_plan_of"]

#: What torchrun sets in every rank (and what a build's ranks get from torch's launcher).
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
#: The mesh's one dimension.
MESH_DIM = "tp"
#: diffusers' marker on a module it sharded (``_parallel_config``) and ours, for a module sharded here.
SHARDED = "_aotbuild_tensor_parallel"


def launched() -> bool:
    """Whether this process is a rank started by torchrun (or by torch's launcher for a build)."""
    return all(os.environ.get(name) for name in RANK_VARIABLES)


def rank_threads(tensor: int) -> int:
    """Intra-op threads per rank: the CPUs this process may use, shared by the ``tensor`` ranks."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS
        cpus = os.cpu_count() or 1
    return max(1, cpus // max(1, tensor))


def backend_for(device: str) -> str:
    """The collective backend of a device kind (a key factor): gloo, nccl, or the device's default."""
    kind = device.partition(":")[0]
    return {"cpu": "gloo", "cuda": "nccl"}.get(kind, f"{kind}:default")


def tp_plan_of(class_name: str) -> dict[str, Any] | None:
    """A diffusers model class's ``_tp_plan`` by name (None: not a diffusers class, or no plan)."""
    try:
        import diffusers

        cls = getattr(diffusers, class_name, None)
    except ImportError:  # pragma: no cover - diffusers is a dependency
        return None
    plan = getattr(cls, "_tp_plan", None) if isinstance(cls, type) else None
    return dict(plan) if plan else None


def _plan_json(plan: dict[str, Any]) -> dict[str, Any]:
    """A ``_tp_plan`` as data: styles by name, diffusers' packed styles with their blocks."""
    return {k: v if isinstance(v, str) else {"style": type(v).__name__, **{a: b for a, b in sorted(vars(v).items())}}
            for k, v in sorted(plan.items())}


def plan_digest(plan: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(_plan_json(plan), sort_keys=True, default=repr).encode()).hexdigest()


def check_component(recipe: Any, component: str, class_name: str, config: dict[str, Any],
                    shardable: list[str]) -> None:
    """When a recipe is planned: the component has a ``_tp_plan`` and the degree divides its heads;
    ``shardable`` (components of the model that have a plan) names the alternatives."""
    tensor = recipe.tensor_parallel
    try:
        import diffusers.hooks.tensor_parallel  # noqa: F401  (the helpers sharding uses)
    except ImportError:
        raise recipe.error("parallel.tensor", "tensor parallelism needs diffusers >= 0.42 (its hooks.tensor_parallel)"
                                              ": pip install -U diffusers") from None
    if tp_plan_of(class_name) is None:
        which = f"components with one: {', '.join(shardable)}" if shardable else "no component of this model has one"
        raise recipe.error("parallel.tensor", f"{component} ({class_name}) has no _tp_plan, so it cannot be sharded "
                                              f"({which}; diffusers 0.42 plans Flux, Flux2 and QwenImage)")
    heads = config.get("num_attention_heads")
    if isinstance(heads, int) and heads % tensor:
        raise recipe.error("parallel.tensor", f"{tensor} does not divide {component}'s {heads} attention heads "
                                              f"(num_attention_heads): choose a divisor of {heads}")


def factors(recipe: Any, class_name: str, device: str, rank: int | None) -> dict[str, Any] | None:
    """The ``parallel`` key factor of one rank's entry; None for an unsharded recipe."""
    tensor = recipe.tensor_parallel
    if tensor == 1:
        return None
    if rank is None or not 0 <= rank < tensor:
        raise ValueError(f"rank {rank} of a {tensor}-way tensor-parallel job")
    plan = tp_plan_of(class_name)
    return {"tensor": tensor, "mesh": [tensor], "backend": backend_for(device),
            "plan": plan_digest(plan) if plan else None, "rank": rank}


_meshes: dict[tuple[str, int], Any] = {}


def setup(recipe: Any, device: str) -> tuple[int, Any]:
    """In a rank: join (or use) the default process group, fix the thread count, build the mesh:
    (rank, mesh). A process that is not one of ``parallel.tensor`` ranks is a clear error."""
    import torch
    import torch.distributed as dist

    tensor, kind = recipe.tensor_parallel, device.partition(":")[0]
    if not dist.is_initialized():
        if not launched():
            raise UsageError(f"{recipe.source}: parallel.tensor is {tensor}: start {tensor} processes, one per rank, "
                             f"e.g. `torchrun --nproc-per-node {tensor} serve.py` (RANK, WORLD_SIZE and LOCAL_RANK "
                             f"are not set here)")
        world = int(os.environ["WORLD_SIZE"])
        if world != tensor:
            raise UsageError(f"{recipe.source}: the world size is {world} (WORLD_SIZE) but parallel.tensor is "
                             f"{tensor}: start {tensor} ranks (torchrun --nproc-per-node {tensor})")
        if kind == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        backend = backend_for(device)
        dist.init_process_group(backend=None if backend.endswith(":default") else backend)
    world = dist.get_world_size()
    if world != tensor:
        raise UsageError(f"{recipe.source}: the process group has {world} ranks but parallel.tensor is {tensor}")
    if kind == "cpu":
        torch.set_num_threads(rank_threads(tensor))
    mesh = _meshes.get((kind, tensor))
    if mesh is None:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(kind, (tensor,), mesh_dim_names=(MESH_DIM,))
        # DeviceMesh.__hash__ hashes a tuple holding None and strings, which differ per process (str
        # hashes are salted); Inductor's FX graph cache key pickles the mesh with that cached hash, so
        # without this no other process (no server, no proof) would ever hit. _stable_hash() is the
        # same key through blake2b: equal meshes still hash equal.
        stable = getattr(mesh, "_stable_hash", None)
        if callable(stable):
            mesh._hash = int(stable()[:15], 16) or 1
        _meshes[(kind, tensor)] = mesh
    return dist.get_rank(), mesh


def shard(module: Any, mesh: Any, component: str) -> None:
    """Shard ``module`` in place by its class's ``_tp_plan`` (a module already sharded is left alone)."""
    if getattr(module, SHARDED, None) or getattr(module, "_parallel_config", None) is not None:
        return
    plan = getattr(type(module), "_tp_plan", None)
    if not plan:
        raise UsageError(f"{component} ({type(module).__name__}) has no _tp_plan: it cannot be sharded")
    if mesh.device_type == "cpu":
        from diffusers.hooks.tensor_parallel import _resolve_tp_plan, _styles, resolve_tp_shard_specs
        from torch.distributed.tensor.parallel import parallelize_module

        try:
            resolve_tp_shard_specs(module, plan, mesh.size())  # every split even, before any weight moves
        except ValueError as exc:
            raise UsageError(f"{component} cannot be split {mesh.size()} ways: {exc}") from None
        for block, relative in _resolve_tp_plan(module, plan):
            parallelize_module(block, mesh, _styles(relative))
    else:
        from diffusers import TensorParallelConfig

        module.enable_parallelism(config=TensorParallelConfig(mesh=mesh))
    setattr(module, SHARDED, mesh.size())


class TensorParallel(Feature):
    """``parallel.tensor``: a job is one entry per rank, each rank's process joins the group (and
    takes its share of the CPUs) before the weights load, and the compiled components are sharded
    by their class's ``_tp_plan`` (:meth:`split`, which ``context.shard_pipeline`` calls)."""

    section = "parallel"

    def check_recipe(self, recipe: Any, model: Any, pipeline_class: str) -> None:
        """A ``_tp_plan`` on every compiled component, heads the degree divides."""
        from aotbuild.pipeline import models

        known = model.components()
        shardable = [n for n, (library, cls) in known.items() if library == "diffusers" and tp_plan_of(cls)]
        for component in recipe.compile.components:
            class_name, config = models.component_config(model, component, recipe.model.revision)
            check_component(recipe, component, class_name, config, shardable)

    def factors(self, recipe: Any, where: Where) -> dict[str, Any] | None:
        return factors(recipe, where.component_class, where.device, where.rank)

    def compile_settings(self, recipe: Any, settings: dict[str, Any]) -> dict[str, Any]:
        if "cpu_threads" not in settings:
            return settings
        # A rank runs rank_threads() threads (setup() sets them in every rank): the process keying it may not.
        return {**settings, "cpu_threads": rank_threads(recipe.tensor_parallel)}

    def ranks(self, recipe: Any) -> int:
        return recipe.tensor_parallel

    def before_load(self, recipe: Any, device: str) -> None:
        setup(recipe, device)  # the rank's device (CUDA: LOCAL_RANK) and its share of the CPUs

    def split(self, pipe: Any, recipe: Any, device: str) -> int | None:
        rank, mesh = setup(recipe, device)  # the group (joined once: setup is idempotent) and this rank
        for component in recipe.compile.components:
            shard(getattr(pipe, component), mesh, component)
        return rank
