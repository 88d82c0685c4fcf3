"""The three conversions, run inside an initialised process group (a world of one, or the
TP x PP ranks of ``hf-to-megatron``). Heavy imports (torch.distributed, megatron) happen here,
not in the CLI, so argument errors are fast."""

from __future__ import annotations

import math
import shutil
import tempfile
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

from conversion.fsutil import ConversionError, swap_into_place

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "fp32": "fp32", "bf16": "bf16"}


def quiet() -> None:
    """Hide megatron's import-time fallback notices (no Apex / TE) from the tool's output."""
    warnings.filterwarnings("ignore", module=r"megatron\..*")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=r".*\.grad attribute of a Tensor.*")


def init_process_group() -> None:
    """gloo on CPU (CUDA hidden by the launcher when there are too few GPUs), else nccl."""
    if dist.is_initialized():
        return
    from megarl.utils.dist import init_distributed, resolve_device

    init_distributed(resolve_device("auto"))


def world_size(tp: int, pp: int, ep: int = 1, etp: int | None = None) -> int:
    """Processes ``hf-to-megatron`` runs: the smallest world that both the dense grid
    (TP x DP) and the expert grid (ETP x EP x expert-DP) divide, times PP."""
    return math.lcm(tp, (tp if etp is None else etp) * ep) * pp


def hf_to_megatron(
    hf: Path, tmp: Path, *, role: str, tp: int, pp: int, dtype: str, ep: int = 1,
    etp: int | None = None,
) -> str:
    """Collective: load ``hf`` at TP x PP (x EP / ETP for experts) and save it (model only) into
    the empty ``tmp``; rank 0 checks every expected tensor is there. Returns a one-line
    summary."""
    quiet()
    init_process_group()
    world, need = dist.get_world_size(), world_size(tp, pp, ep, etp)
    if world != need:
        raise ConversionError(
            f"--tp {tp} x --pp {pp} (--ep {ep}, --etp {etp}) needs {need} processes, got {world}"
        )
    from megarl.backends.megatron import MegatronBackend
    from megarl.backends.megatron.checkpoint import check_model_tensors
    from megarl.models.hf_io import hf_weight_map

    backend = MegatronBackend(role, str(hf), tp=tp, pp=pp, ep=ep, etp=etp, dtype=dtype,
                              train=False)
    backend.save(str(tmp), include_optimizer=False)
    summary = ""
    if dist.get_rank() == 0:
        n = check_model_tensors(tmp, backend.args, role, backend.num_labels)
        n_hf = len(hf_weight_map(hf))
        summary = (
            f"wrote {n} megatron tensors (from {n_hf} HF tensors, {backend.args.model_type} "
            f"{role}, {dtype}) at TP={tp} PP={pp}" + (f" EP={ep}" if ep > 1 else "")
        )
    dist.barrier()
    return summary


def megatron_to_hf(ckpt: Path, out: Path, *, dtype: str | None, force: bool) -> str:
    """Single process: load ``ckpt`` (any layout it was written at) and write an HF folder."""
    quiet()
    init_process_group()
    from megarl.backends.megatron import MegatronBackend
    from megarl.backends.megatron.checkpoint import read_meta
    from megarl.backends.megatron.weights import expected_hf_names
    from megarl.models.hf_io import hf_weight_map, save_hf_checkpoint
    from megarl.models.loading import hf_config_for

    meta = read_meta(ckpt)
    backend = MegatronBackend.from_checkpoint(str(ckpt))
    role, args = backend.role, backend.args
    if dtype is None:  # the source model's dtype, else fp32
        src = meta["hf_config"].get("dtype") or meta["hf_config"].get("torch_dtype") or "fp32"
        dtype = _DTYPE_NAMES.get(str(src), "fp32")
    head = "lm" if role in ("actor", "ref") else "token_cls"
    config = hf_config_for(
        SimpleNamespace(args=args, head=head, num_labels=backend.num_labels or 2)
    )
    for key in ("dtype", "torch_dtype"):
        config[key] = "bfloat16" if dtype == "bf16" else "float32"
    source = meta.get("source")
    source_dir = source if source and Path(source).is_dir() else None

    parent = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        target = parent / "hf"
        save_hf_checkpoint(
            target, backend.export_weights(), config, dtype=_DTYPES[dtype], source_dir=source_dir
        )
        written = set(hf_weight_map(target))
        expected = set(expected_hf_names(args, role))
        missing, extra = sorted(expected - written), sorted(written - expected)
        if missing or extra:
            raise ConversionError(
                f"HF output incomplete: missing {missing or 'none'}, unexpected {extra or 'none'}"
            )
        swap_into_place(target, out, force=force)
    finally:
        shutil.rmtree(parent, ignore_errors=True)
    return (
        f"wrote {len(written)} HF tensors ({args.model_type} {role}, {dtype}) to {out} "
        f"from a checkpoint written at TP={meta.get('tp')} PP={meta.get('pp')}"
    )


def verify(hf: Path, ckpt: Path, *, tol: float, seq_len: int = 24) -> tuple[bool, str]:
    """Single process: outputs of the HF folder (transformers, float32) and of the megatron
    checkpoint on a fixed batch; (passed, report line)."""
    quiet()
    init_process_group()
    import transformers

    from megarl.backends.megatron import MegatronBackend
    from megarl.backends.protocol import SequenceBatch

    backend = MegatronBackend.from_checkpoint(str(ckpt))
    args, role = backend.args, backend.role
    T = min(seq_len, args.max_position_embeddings)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab_size, (2, T), generator=gen)
    batch = SequenceBatch(ids, torch.ones_like(ids), T - 1)
    if role in ("actor", "ref"):
        model = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
        what = "logits"
    else:
        model = transformers.AutoModelForTokenClassification.from_pretrained(
            hf, dtype=torch.float32
        )
        what = "values" if role == "critic" else "token scores"
    model.eval()
    with torch.no_grad():
        ref = model(input_ids=ids).logits.float()
    if role in ("actor", "ref"):
        ours, ref = backend.logits(batch), ref[:, :-1]
    elif role == "critic":
        ours, ref = backend.values(batch), ref[:, :-1, 0]
    else:
        ours, ref = backend.token_scores(batch), ref[:, 1:]
    if ours.shape != ref.shape:
        return False, f"shape mismatch: checkpoint {tuple(ours.shape)} vs HF {tuple(ref.shape)}"
    diff = float((ours - ref).abs().max())
    passed = diff <= tol
    verdict = "OK" if passed else "MISMATCH"
    return passed, (
        f"{verdict}: max abs diff of {what} = {diff:.3e} (tol {tol:g}) on a fixed batch of "
        f"2 x {T} tokens ({args.model_type} {role})"
    )

