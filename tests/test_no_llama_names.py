"""No Llama module name outside the Llama family's own files: parallel/, topology/ and the runtime read a
spec (models/spec.py), so a second family (Qwen3, with Hugging Face's names) and a user's model go through
the same code. The check reads the source of every library module and looks for Llama's module and
parameter names as identifiers or strings."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LLAMA_NAMES = (
    "tok_embeddings",
    "attention_norm",
    "ffn_norm",
    "feed_forward",
    "wq",
    "wk",
    "wv",
    "wo",
    "w1",
    "w2",
    "w3",
    "llama_plan",
)
# the Llama family's own files; runtime/commands/baseline.py is the plain-PyTorch Llama that tessera's Llama is timed
# against (`python -m tessera.commands.baseline`): a Llama by design, imported by nothing in the library
FAMILY_FILES = {"models/llama.py", "runtime/commands/baseline.py"}


def test_no_llama_module_name_outside_the_llama_family():
    pattern = re.compile(r"(?<![A-Za-z0-9_])(" + "|".join(LLAMA_NAMES) + r")(?![A-Za-z0-9_])")
    leaks = []
    for folder in ("parallel", "topology", "runtime", "kernels", "models"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in FAMILY_FILES:
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                code = line.split("#", 1)[0]
                if pattern.search(code):
                    leaks.append(f"{rel}:{n}: {line.strip()}")
    assert not leaks, "Llama names outside the Llama family:\n" + "\n".join(leaks)
