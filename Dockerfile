# The cluster container: numloss + DeepSpeed + Megatron-core + Ray on NVIDIA's PyTorch image.
#
#   docker build -t numloss .
#   docker run --gpus all --ipc=host --rm -it numloss python -m recipes.demo
#
# Base: NGC PyTorch 25.11 (Python 3.12). It ships a CUDA build of torch together with CUDA, cuDNN, NCCL
# and NVIDIA apex (the real one; PyPI's `apex` is an unrelated package), plus the compilers DeepSpeed and
# flash-attn need. Any newer nvcr.io/nvidia/pytorch:YY.MM-py3 tag works the same way:
#   docker build --build-arg BASE_IMAGE=nvcr.io/nvidia/pytorch:26.10-py3 -t numloss .
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.11-py3
FROM ${BASE_IMAGE}

# Keep these equal to pyproject.toml's pins (tests/test_packaging.py checks it).
ARG DEEPSPEED_VERSION=0.19.8
ARG RAY_VERSION=2.60.0
ARG FLASH_ATTN_VERSION=2.8.3
# GPUs to build DeepSpeed's kernels for: A100 (8.0), H100/H200/GH200 (9.0), B200/GB200 (10.0; CUDA 12.8 or
# newer, which NGC 25.11's CUDA 13 is). There is no GPU during `docker build`, so the architectures cannot
# be detected and must be given; the build checks that the base image's torch was compiled for them.
ARG TORCH_CUDA_ARCH_LIST="8.0;9.0;10.0"
ARG MAX_JOBS=8
# 1: compile flash-attn from source when the base image has none (hours on a build machine); default 0:
# such a base image fails the build at once, saying so.
ARG BUILD_FLASH_ATTN=0

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# Keeping the base image's torch.
# The image's torch is an NVIDIA build (version like 2.x.0a0+<commit>.nvYY.MM) linked against its CUDA,
# NCCL and apex. If pip ever replaced it with a PyPI wheel, apex, Transformer Engine and every kernel
# compiled below would break, or a second multi-GB CUDA runtime would arrive. pip keeps an installed
# package that satisfies a requirement (deepspeed and flash-attn only ask for `torch`, numloss for
# `torch>=2.4`), so nothing should touch it; the constraints file turns "should" into "cannot": it pins
# torch and the packages built against it to exactly what the image has, so a dependency that wants
# another torch fails the build loudly instead of silently swapping it.
# NGC's own PIP_CONSTRAINT file (/etc/pip/constraint.txt) pins about every package the image has,
# numpy included; it is replaced, not extended, so that our non-torch dependencies (datasets, pyarrow,
# ray) can resolve, while the torch-linked ones stay frozen.
ENV PIP_CONSTRAINT=/opt/numloss/constraints.txt \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TORCH_EXTENSIONS_DIR=/opt/torch_extensions
# TORCH_EXTENSIONS_DIR is world-writable: enroot/pyxis and Apptainer run the image as the submitting
# user, and any op DeepSpeed still JIT-compiles must land somewhere writable.
RUN mkdir -p /opt/numloss /opt/torch_extensions && chmod 1777 /opt/torch_extensions \
 && python -c "import importlib.metadata as md; \
keep = {'torch', 'torchvision', 'torchaudio', 'triton', 'pytorch-triton', 'apex', 'flash-attn', 'transformer-engine'}; \
pins = sorted({f'{d.metadata[\"Name\"]}=={d.version}' for d in md.distributions() \
               if (d.metadata['Name'] or '').lower().replace('_', '-') in keep}); \
assert any(p.lower().startswith('torch==') for p in pins), 'no torch in the base image'; \
open('/opt/numloss/constraints.txt', 'w').write(''.join(p + chr(10) for p in pins))" \
 && cat /opt/numloss/constraints.txt

# The base image's torch must have kernels for every architecture above (else DeepSpeed's ops and the
# model's own kernels would not run on those GPUs).
RUN python -c "import torch; flags = torch._C._cuda_getArchFlags() if hasattr(torch._C, '_cuda_getArchFlags') else ''; \
want = ['sm_' + a.replace('.', '') for a in '${TORCH_CUDA_ARCH_LIST}'.split(';')]; \
missing = [w for w in want if flags and w not in flags.split()]; print('torch CUDA archs:', flags); \
assert not missing, f'the base image torch has no kernels for {missing}: another BASE_IMAGE or TORCH_CUDA_ARCH_LIST'"

# flash-attn: the NGC image already has a build matching its torch (frozen above). A base image without it
# fails here unless BUILD_FLASH_ATTN=1 asks for a source build (hours: flash-attn publishes no wheel for
# NGC's torch); --no-build-isolation builds against the installed torch.
RUN python -c "import flash_attn" 2>/dev/null \
 || { [ "${BUILD_FLASH_ATTN}" = 1 ] && MAX_JOBS=${MAX_JOBS} pip install --no-build-isolation "flash-attn==${FLASH_ATTN_VERSION}"; } \
 || { echo "the base image has no flash-attn: use an NGC PyTorch image (it has one), or build with --build-arg BUILD_FLASH_ATTN=1 (compiles it: hours)" >&2; exit 1; }

# DeepSpeed with FusedAdam (GPU) and CPUAdam (ZeRO-Offload) compiled now, so a job does not spend its
# first minute compiling them with gcc/nvcc on every node. DS_ACCELERATOR=cuda because there is no GPU
# at build time and DeepSpeed would otherwise pick its CPU accelerator and build the wrong ops.
# --no-build-isolation: the ops must be compiled against the image's torch. py-cpuinfo is needed to
# build CPUAdam; ninja is in the base image (left unpinned: pip keeps the installed one).
# The check reads what DeepSpeed recorded at install: it loads a prebuilt op only when it was built for
# the accelerator it runs on ("cuda"), else it JIT-compiles at job start after all.
# hadolint ignore=DL3013
RUN pip install py-cpuinfo==9.0.0 ninja \
 && DS_ACCELERATOR=cuda DS_BUILD_OPS=0 DS_BUILD_FUSED_ADAM=1 DS_BUILD_CPU_ADAM=1 \
    TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST}" MAX_JOBS=${MAX_JOBS} \
    pip install --no-build-isolation "deepspeed==${DEEPSPEED_VERSION}" \
 && python -c "from deepspeed.git_version_info import installed_ops as ops, accelerator_name as acc; \
assert ops['fused_adam'] and ops['cpu_adam'] and acc == 'cuda', (acc, ops)"

# Ray Train for the workers, plus ray[default] (dashboard, Jobs API, `ray start` on every node) so the
# image can be a cluster's head: `python -m launch.ray submit` and the SLURM template use them.
RUN pip install "ray[train]==${RAY_VERSION}" "ray[default]==${RAY_VERSION}"

# The project, installed the way the README says: `pip install -e ".[train,ray,megatron,hf,eval]"` (hf: TRL
# and PEFT, for NumericSFTTrainer and the recipes' LoRA; eval: lm-evaluation-harness, for
# `python -m recipes.evaluate harness`, which uses the vllm package where an image has one). Its deepspeed
# and ray pins are already satisfied by the layers above, so this only adds the light dependencies
# (transformers, tokenizers, datasets, pyarrow, ..., megatron-core, whose GPU kernels come from the base
# image: apex and Transformer Engine, which the Megatron engine uses when they import). The GPU defaults for DeepSpeed apply here: the
# Makefile's DS_ACCELERATOR=cpu is for CPU machines and is not set in this image.
WORKDIR /workspace/numloss
COPY . /workspace/numloss
# hadolint ignore=DL3013
RUN pip install -e ".[train,ray,megatron,hf,eval]" \
 && python -c "import torch, numloss, deepspeed, ray, transformers, trl, peft, megatron.core, lm_eval; \
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.distributed.is_nccl_available()); \
print('numloss', numloss.__file__, 'deepspeed', deepspeed.__version__, 'ray', ray.__version__)" \
 && python -c "import launch.ray, launch.slurm, launch.sweep, ray.dashboard.modules.job.sdk" \
 && ray --version

# The Megatron engine's GPU path (recipes/engines/megatron/pure/kernels.py) needs two things from the base image:
# Transformer Engine (its layer spec, fused attention with THD packing, fused RoPE) and apex's CUDA
# extension fused_weight_gradient_mlp_cuda (gradient_accumulation_fusion: each micro-batch's weight
# gradients accumulated into fp32 by the GEMM). Without either the engine still runs (megatron's local spec
# and block mask, or no gradient-accumulation fusion; the run log's "[numloss] megatron:" line says which),
# but slower: fail the build instead. Found without importing them (their CUDA libraries need a GPU,
# and there is none during `docker build`).
RUN python -c "import importlib.util as u; \
missing = [m for m in ('transformer_engine', 'fused_weight_gradient_mlp_cuda') if u.find_spec(m) is None]; \
assert not missing, f'the base image lacks {missing}: the Megatron engine would fall back to slower kernels'; \
print('transformer_engine and apex fused_weight_gradient_mlp_cuda: present')"
