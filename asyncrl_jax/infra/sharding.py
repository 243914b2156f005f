"""Meshes and logical-axis sharding.

Every role (learner, rollout) gets its own mesh with axes ``(data, fsdp, expert, tensor)``.
Parameters and activations carry logical axis names; ``LOGICAL_RULES`` maps them onto mesh axes:

=================  =====================  ================================================
logical axis        mesh axes              used by
=================  =====================  ================================================
batch               (data, fsdp, expert)   token / activation batch dimension
embed               fsdp                   hidden dimension of weights (FSDP: weights split)
heads, kv_heads     tensor                 attention heads (Megatron-style tensor parallel)
mlp                 tensor                 MLP hidden dimension
moe_mlp             tensor                 each expert's MLP hidden dimension
expert              expert                 the experts of a mixture-of-experts layer
vocab               tensor                 embedding rows / logits columns
=================  =====================  ================================================

Dimensions not listed (head_dim, norm scales, sequence length) are replicated.

The ``expert`` axis (expert parallelism) splits each MoE layer's experts, their gradients and AdamW
moments; everything else treats it as one more data-parallel axis (rows are split over it, dense
weights are not). Tokens reach the shard that holds their experts by all-to-all inside the MoE layer
(``models.moe``). A mesh without the axis in its config has ``expert=1``.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, NamedTuple, Optional, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "expert", "tensor")
BATCH_AXES = ("data", "fsdp", "expert")  # the axes rows (slots, sequences, tokens) are split over

LOGICAL_RULES: tuple[tuple[str, Any], ...] = (
    ("batch", BATCH_AXES),
    ("activation_batch", BATCH_AXES),
    ("activation_length", None),
    ("activation_embed", None),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("vocab", "tensor"),
    ("head_dim", None),
    ("norm", None),
    # mixture of experts (models.moe): the experts over the expert axis, each expert's MLP width over
    # tensor like a dense MLP's; the router's expert columns replicated
    ("expert", "expert"),
    ("expert_router", None),
    ("moe_mlp", "tensor"),
)


class MeshError(ValueError):
  """A mesh shape does not fit the devices or the model."""


def resolve_mesh_shape(shape: Mapping[str, int], num_devices: int, *, role: str = "mesh") -> dict:
  """Fills one ``-1`` entry so the product of axis sizes equals ``num_devices``."""
  unknown = [k for k in MESH_AXES if int(shape.get(k, 1)) == -1]
  sizes = {k: int(shape.get(k, 1)) for k in MESH_AXES}
  extra = set(shape) - set(MESH_AXES)
  if extra:
    raise MeshError(f"{role}: unknown mesh axes {sorted(extra)}; allowed: {MESH_AXES}")
  if len(unknown) > 1:
    raise MeshError(f"{role}: at most one mesh axis may be -1, got {unknown}")
  for k, v in sizes.items():
    if v == 0 or v < -1:
      raise MeshError(f"{role}.{k}={v}: mesh axis sizes must be positive (or -1 for 'the rest')")
  known = math.prod(v for v in sizes.values() if v != -1)
  if unknown:
    if num_devices % known:
      raise MeshError(f"{role}: {num_devices} devices are not divisible by the fixed axes {sizes}")
    sizes[unknown[0]] = num_devices // known
  if math.prod(sizes.values()) != num_devices:
    raise MeshError(f"{role}: mesh {sizes} needs {math.prod(sizes.values())} devices, "
                    f"but {num_devices} are assigned")
  return sizes


def batch_ways(mesh: Mesh) -> int:
  """How many ways rows are split on ``mesh``: the product of its ``BATCH_AXES``."""
  return math.prod(int(mesh.shape.get(a, 1)) for a in BATCH_AXES)


def make_mesh(devices: Sequence[jax.Device], shape: Mapping[str, int], *, role: str = "mesh") -> Mesh:
  """A mesh with axes (data, fsdp, expert, tensor) over exactly ``devices`` (Auto axis types); an
  axis missing from ``shape`` has size 1."""
  sizes = resolve_mesh_shape(shape, len(devices), role=role)
  devices = sorted(devices, key=lambda d: (d.process_index, d.id))  # tensor groups within a host
  grid = np.asarray(devices, dtype=object).reshape([sizes[k] for k in MESH_AXES])
  for group in grid.reshape(-1, sizes["tensor"]):
    if len({d.process_index for d in group}) > 1:
      raise MeshError(f"{role}.tensor={sizes['tensor']} spans processes {sorted({d.process_index for d in group})}: "
                      "tensor parallelism stays within a host; give each process a multiple of it")
  return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def split_devices(devices: Sequence[jax.Device], rollout_fraction: float
                  ) -> tuple[list[jax.Device], list[jax.Device]]:
  """Splits devices into (rollout, learner) lists; each gets at least one device."""
  n = len(devices)
  if n < 2:
    raise MeshError(f"need at least 2 devices to split rollout and learner, have {n}; on CPU set "
                    "XLA_FLAGS=--xla_force_host_platform_device_count=N before jax is imported")
  if not 0.0 < rollout_fraction < 1.0:
    raise MeshError(f"mesh.rollout_fraction={rollout_fraction}: must be strictly between 0 and 1")
  n_rollout = min(n - 1, max(1, round(n * rollout_fraction)))
  return list(devices[:n_rollout]), list(devices[n_rollout:])


def logical_specs(abstract_boxed_params: Any) -> Any:
  """Logical PartitionSpecs of a pytree of ``nn.LogicallyPartitioned`` (from ``jax.eval_shape``)."""
  return nn.get_partition_spec(abstract_boxed_params)


def mesh_shardings(logical_spec_tree: Any, mesh: Mesh,
                   rules: Sequence[tuple[str, Any]] = LOGICAL_RULES) -> Any:
  """Maps a tree of logical PartitionSpecs to NamedShardings on ``mesh``."""
  return nn.logical_to_mesh_sharding(logical_spec_tree, mesh, tuple(rules))


def check_divisible(shapes: Any, shardings: Any) -> None:
  """Raises MeshError naming the first array whose dimensions do not divide over its mesh axes."""
  flat_shapes = jax.tree_util.tree_flatten_with_path(shapes)[0]
  flat_shardings = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, NamedSharding))
  for (path, shape), sharding in zip(flat_shapes, flat_shardings):
    for dim, axes in zip(shape.shape, sharding.spec):
      if axes is None:
        continue
      axes = axes if isinstance(axes, tuple) else (axes,)
      size = math.prod(sharding.mesh.shape[a] for a in axes)
      if dim % size:
        raise MeshError(f"{jax.tree_util.keystr(path)} has shape {shape.shape}: dimension {dim} does "
                        f"not divide over mesh axes {axes} of total size {size}; change the mesh shape")


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
  """Shards the leading (batch) dimension over ``BATCH_AXES``; other dimensions replicated."""
  return NamedSharding(mesh, PartitionSpec(BATCH_AXES, *([None] * (ndim - 1))))


def describe(mesh: Optional[Mesh]) -> str:
  if mesh is None:
    return "no mesh"
  return " x ".join(f"{k}={v}" for k, v in mesh.shape.items()) + f" ({mesh.devices.size} devices)"


class RoleMeshes(NamedTuple):
  """The devices of each role: the learner's mesh (over every learner process's devices), the rollout
  mesh (None when the decode servers are ``remote`` other processes), and whether both roles share
  every device (taking turns)."""
  learner: Mesh
  rollout: Optional[Mesh]
  remote: int
  colocated: bool

  def describe(self) -> str:
    devices = jax.devices()
    out = (f"{len(devices)} {devices[0].platform} devices in {jax.process_count()} learner "
           f"process{'es' if jax.process_count() > 1 else ''}: learner {describe(self.learner)}")
    if self.rollout is None:
      return out + f"; {self.remote} decode-server processes"
    return out + f", rollout {describe(self.rollout)}" + (
        " (the same devices, taking turns)" if self.colocated else "")


def role_meshes(config) -> RoleMeshes:
  """One mesh per role from ``config.mesh``: a split of the local devices (``mesh.rollout_fraction``),
  both roles on every device (``mesh.colocate``), or every device of every learner process learning
  when the decode servers are other processes (``rollout.servers``)."""
  remote = int(config.rollout.servers)
  devices = list(jax.devices())
  if jax.process_count() > 1 and not remote:
    raise MeshError(f"{jax.process_count()} learner processes need their decode servers in other "
                    "processes: set rollout.servers")
  if remote:
    rollout_devices, learner_devices = [], devices
  elif config.mesh.colocate:
    rollout_devices = learner_devices = devices
  else:
    rollout_devices, learner_devices = split_devices(devices, config.mesh.rollout_fraction)
  learner = make_mesh(learner_devices, config.mesh.learner.to_dict(), role="mesh.learner")
  rollout = (make_mesh(rollout_devices, config.mesh.rollout.to_dict(), role="mesh.rollout")
             if rollout_devices else None)
  return RoleMeshes(learner, rollout, remote, bool(config.mesh.colocate) and not remote)
