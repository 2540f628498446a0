"""Hand check: ``runahead convert`` against llama.cpp's own converter and quantizer, same tiny models.

Not in CI (it needs llama.cpp's source and llama-cpp-python). Get the converter from
llama-cpp-python's source archive and the wheel (FACTS.md):

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/lcp
    tar xzf /tmp/lcp/llama_cpp_python-0.3.36.tar.gz -C /tmp/lcp
    pip install --target /tmp/sp sentencepiece  # the converter imports it for llama (Mixtral)
    pip install llama_cpp_python-0.3.36-py3-none-linux_x86_64.whl
    PYTHONPATH=$PWD:/tmp/sp python bench/gguf_converter_check.py \\
        /tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp qwen3_moe qwen2_moe olmoe mixtral gemma4

For each architecture it builds the tiny model (with a byte-level BPE tokenizer) and

- for F32, F16 and Q8_0: runs ``convert_hf_to_gguf.py --outtype`` and ``runahead convert`` and
  prints the tensors and metadata keys that differ (names, types, shapes, bytes, values);
- for Q4_0 (which the converter leaves to ``llama-quantize``): quantizes the converter's F32 file
  with llama.cpp's own ``llama_model_quantize`` (``pure``: every matrix Q4_0) and compares it the
  same way with ``runahead convert --type q4_0``;
- loads ours with llama.cpp (``llama_cpp.Llama``) and decodes a few tokens.

The converter refuses tokenizers it does not recognise by hash, so its pre-tokenizer lookup is
patched to answer what ``runahead convert`` writes for the architecture. Gemma 4 gets a tokenizer
of Gemma's kind instead (BPE with byte fallback: ``ggufhelpers.save_gemma_tokenizer``), which the
converter writes as tokenizer model ``gemma4``.
"""

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, "tests")
import numpy as np
from ggufhelpers import OVERRIDES, save_gemma_tokenizer

from runahead.models.gguf_convert import PRE_TOKENIZER, convert
from runahead.tokenizer import save_tokenizer

from modelhelpers import build_tiny_model

LL = Path(sys.argv.pop(1))
WORK = Path(tempfile.mkdtemp(prefix="gguf-check-"))
IGNORED = {"general.name", "general.size_label"}  # the folder's name; the converter rounds sizes its way


def run_converter(hf: Path, out: Path, outtype: str, pre: str, extra: tuple[str, ...] = ()) -> bool:
    runner = WORK / "run_conv.py"
    runner.write_text(f'''
import sys
sys.argv = sys.argv[1:]
sys.path.insert(0, "{LL}")
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "{pre}"
import runpy
runpy.run_path("{LL}/convert_hf_to_gguf.py", run_name="__main__")
''')
    r = subprocess.run(
        [sys.executable, str(runner), "x", str(hf), "--outtype", outtype, "--outfile", str(out), *extra],
        capture_output=True,
        text=True,
    )
    if r.returncode:
        print(r.stderr[-3000:])
    return r.returncode == 0


def llama_quantize(src: Path, out: Path) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = 2  # LLAMA_FTYPE_MOSTLY_Q4_0
    params.pure = True
    params.nthread = 2
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params) == 0


def compare(label: str, real: Path, ours: Path) -> bool:
    from gguf import GGUFReader

    a, b = GGUFReader(real), GGUFReader(ours)
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    diff = [
        (n, ta[n].tensor_type.name, tb[n].tensor_type.name, list(ta[n].shape), list(tb[n].shape))
        for n in ta
        if n in tb
        and (
            ta[n].tensor_type != tb[n].tensor_type
            or list(ta[n].shape) != list(tb[n].shape)
            or not np.array_equal(
                np.asarray(ta[n].data).view(np.uint8), np.asarray(tb[n].data).view(np.uint8)
            )
        )
    ]
    ka = {k for k in a.fields if not k.startswith("GGUF.")}
    kb = {k for k in b.fields if not k.startswith("GGUF.")}
    values = [
        (k, str(a.fields[k].contents())[:60], str(b.fields[k].contents())[:60])
        for k in sorted(ka & kb - IGNORED)
        if a.fields[k].contents() != b.fields[k].contents()
    ]
    report = {
        "tensors only in llama.cpp's": sorted(set(ta) - set(tb)),
        "tensors only in ours": sorted(set(tb) - set(ta)),
        "tensors differing (type/shape/bytes)": diff[:6],
        "keys only in llama.cpp's": sorted(ka - kb),
        "keys only in ours": sorted(kb - ka),
        "keys with other values": values,
    }
    same = not any(report.values())
    print(f"{label}: {len(ta)} tensors, {len(ka)} keys: {'identical' if same else 'DIFFERENT'}")
    for what, items in report.items():
        if items:
            print(f"  {what}: {items}")
    return same


def llama_cpp_decodes(path: Path) -> list[int]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, n_threads=2, logits_all=True, verbose=False)
    llm.eval([5, 17, 40])
    tokens = []
    for _ in range(4):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        tokens.append(token)
        llm.eval([token])
    return tokens


for arch in sys.argv[1:]:
    d = WORK / arch
    shutil.rmtree(d, ignore_errors=True)
    # llama.cpp's qwen35 takes the value heads' width from the key heads' (equal in the real models)
    same_width = {"linear_value_head_dim": 8} if arch.startswith("qwen3_5") else {}
    hf = build_tiny_model(arch, d / "hf", **{**OVERRIDES[arch], "vocab_size": 512, **same_width})
    for stale in ("tokenizer.json", "tokenizer_config.json"):
        (hf / stale).unlink(missing_ok=True)
    (save_gemma_tokenizer if arch == "gemma4" else save_tokenizer)(hf, 512)
    pre = PRE_TOKENIZER.get(arch, "default")  # gemma4: its tokenizer model, no pre-tokenizer name
    for kind in ("F32", "F16", "Q8_0"):
        real = d / f"real-{kind}.gguf"
        # the tiny models have no multi-token-prediction layers (runahead convert writes none)
        extra = ("--no-mtp",) if arch.startswith("qwen3_5") else ()
        if run_converter(hf, real, kind.lower(), pre, extra):
            compare(f"{arch} {kind}", real, convert(hf, d / f"ours-{kind}.gguf", kind)[0])
    real_q4 = d / "real-Q4_0.gguf"
    llama_quantize(d / "real-F32.gguf", real_q4)
    ours_q4 = convert(hf, d / "ours-Q4_0.gguf", "Q4_0")[0]
    compare(f"{arch} Q4_0 (llama_model_quantize --pure of the converter's F32)", real_q4, ours_q4)
    try:
        print(f"{arch}: llama.cpp loads our Q4_0 file and decodes {llama_cpp_decodes(ours_q4)}")
    except ValueError as err:  # llama.cpp's olmoe wants as many KV heads as heads (FACTS.md)
        print(f"{arch}: llama.cpp refuses our Q4_0 file: {err}")
