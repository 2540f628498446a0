"""Hand check: tests/ggufhelpers.write_gguf against llama.cpp's own convert_hf_to_gguf.py, same tiny models.

Not in CI (it needs llama.cpp's source). Get the converter from llama-cpp-python's source archive:

    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d /tmp/lcp
    tar xzf /tmp/lcp/llama_cpp_python-0.3.36.tar.gz -C /tmp/lcp
    pip install --target /tmp/sp sentencepiece  # the converter imports it for llama (Mixtral)
    PYTHONPATH=$PWD:/tmp/sp python bench/gguf_converter_check.py \\
        /tmp/lcp/llama_cpp_python-0.3.36/vendor/llama.cpp qwen3_moe qwen2_moe olmoe mixtral

For each architecture it converts the tiny model (with a byte-level BPE tokenizer) with
``--outtype q8_0`` and with our writer at Q8_0, then prints the tensors and metadata keys that
differ (names, types, shapes, bytes, values). The converter refuses tokenizers it does not
recognise by hash, so its pre-tokenizer lookup is patched to answer ``qwen2``.
"""

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, "tests")
import numpy as np
from ggufhelpers import OVERRIDES, write_gguf

from runahead.tokenizer import save_tokenizer

from modelhelpers import build_tiny_model

LL = Path(sys.argv.pop(1))
WORK = Path(tempfile.mkdtemp(prefix="gguf-check-"))
runner = WORK / "run_conv.py"
runner.write_text(f'''
import sys
sys.argv = sys.argv[1:]
sys.path.insert(0, "{LL}")
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
import runpy
runpy.run_path("{LL}/convert_hf_to_gguf.py", run_name="__main__")
''')
for arch in sys.argv[1:]:
    d = WORK / arch
    shutil.rmtree(d, ignore_errors=True)
    hf = build_tiny_model(arch, d / "hf", **{**OVERRIDES[arch], "vocab_size": 512})
    for stale in ("tokenizer.json", "tokenizer_config.json"):
        (hf / stale).unlink(missing_ok=True)
    save_tokenizer(hf, 512)
    real = d / "real.gguf"
    r = subprocess.run(
        [sys.executable, str(runner), "x", str(hf), "--outtype", "q8_0", "--outfile", str(real)],
        capture_output=True,
        text=True,
    )
    if r.returncode:
        print(r.stderr[-3000:])
        continue
    ours = write_gguf(hf, d / "ours.gguf", "Q8_0", tokenizer=True)
    from gguf import GGUFReader

    a, b = GGUFReader(real), GGUFReader(ours)
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    print(
        arch, "tensors only in real:", sorted(set(ta) - set(tb)), "only in ours:", sorted(set(tb) - set(ta))
    )
    diff = [
        n
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
    print(
        arch,
        "tensors differing (type/shape/bytes):",
        [
            (n, ta[n].tensor_type.name, tb[n].tensor_type.name, list(ta[n].shape), list(tb[n].shape))
            for n in diff
        ][:6],
    )
    ka, kb = set(a.fields), set(b.fields)
    print(arch, "keys only in real:", sorted(k for k in ka - kb if not k.startswith("GGUF.")))
    print(arch, "keys only in ours:", sorted(kb - ka))
    vals = [
        k
        for k in ka & kb
        if not k.startswith("GGUF.")
        and k not in ("general.name",)
        and a.fields[k].contents() != b.fields[k].contents()
    ]
    print(
        arch,
        "keys with different values:",
        [(k, str(a.fields[k].contents())[:60], str(b.fields[k].contents())[:60]) for k in vals],
    )
