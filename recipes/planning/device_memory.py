"""The GPU memory a plan may fill: what torch sees of the device, less a margin.

A GPU sold as 80 GB shows torch less (`torch.cuda.get_device_properties(0).total_memory`: about 79.1 GiB
on an 80 GB H100, about 139.8 GiB on a 141 GB H200: figures reported to this project, not measured here), and
the caching allocator cannot hand out all of that: blocks split by earlier tensors of other sizes
(fragmentation), the CUDA context, NCCL's and the libraries' workspaces beyond the plan's fixed buffers.
`recipes.validate` therefore compares its plan with `usable = exposed x (1 - MARGIN)`, MARGIN = 10 %: a
recipe planned at 75 GiB is refused on an 80 GB GPU (71.2 GiB usable), as it would most likely fail at
its first step there.

`cluster.gpu_mem_gb` / `--gpu-mem-gb` name the device: a size in `EXPOSED_GIB` is the marketed size and
maps to what torch shows; any other value is taken as what torch shows (read it on the machine).
"""

from __future__ import annotations

from dataclasses import dataclass

# marketed size -> GiB torch reports: both figures as reported to this project, not measured here (no GPU)
EXPOSED_GIB = {80.0: 79.1, 141.0: 139.8}
MARGIN = 0.10  # of the exposed memory: fragmentation, the CUDA context, workspaces the plan leaves out


@dataclass(frozen=True)
class DeviceMemory:
    given_gib: float  # cluster.gpu_mem_gb / --gpu-mem-gb (or the GPU's table size)
    exposed_gib: float  # what torch sees
    usable_gib: float  # what a plan may fill

    def line(self) -> str:
        seen = (f"a GPU sold as {self.given_gib:g} GB: torch sees {self.exposed_gib:g} GiB"
                if self.exposed_gib != self.given_gib else f"torch sees {self.exposed_gib:g} GiB")
        return (f"{seen}; the plan may fill {self.usable_gib:.1f} GiB ({MARGIN:.0%} kept for allocator "
                f"fragmentation, the CUDA context and workspaces; --gpu-mem-gb / cluster.gpu_mem_gb)")


def device_memory(mem_gib: float) -> DeviceMemory:
    exposed = EXPOSED_GIB.get(float(mem_gib), float(mem_gib))
    return DeviceMemory(float(mem_gib), exposed, exposed * (1 - MARGIN))
