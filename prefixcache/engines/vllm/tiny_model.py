"""Write a tiny random-weight Llama and its word-level tokenizer, for real engines without a
download.

Run with the engine's own interpreter (it needs torch, transformers and tokenizers, none of
which the service needs)::

    python tiny_model.py OUT_DIR

The model: 2 layers, hidden size 256, 4 attention heads, 2 KV heads, a 32,000-token vocabulary,
4,096 positions, float32 weights drawn from a fixed seed (about 71 MB). The tokenizer is
word-level: ``<unk>``, ``<s>`` and ``</s>`` are ids 0-2 and the word ``w{i}`` is id ``i + 3``,
split on whitespace, with no special token added to a prompt, so the text ``"w5 w9"`` is the
token ids ``[8, 12]`` for the engine and for the service alike. ``tokenizer_config.json`` holds a
plain chat template (each message as ``role: content``) for chat completions.

The same arguments write the same files; a folder already written with this layout (its
``prefixcache-model.json``) is left as it is. The files are written to a temporary folder beside
``OUT_DIR`` and renamed into place, so an interrupted run leaves nothing half written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

VOCAB_SIZE = 32000
MAX_POSITIONS = 4096
SEED = 0
SHAPE = {
    "num_hidden_layers": 2,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}
LAYOUT = {
    "architecture": "LlamaForCausalLM",
    **SHAPE,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": MAX_POSITIONS,
    "dtype": "float32",
    "seed": SEED,
    "tokenizer": "word-level w{i} -> i+3",
    "version": 1,
}
MARKER = "prefixcache-model.json"
SPECIAL = ("<unk>", "<s>", "</s>")
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


def is_written(out: Path) -> bool:
    """Whether ``out`` holds a model of this layout."""
    try:
        return json.loads((out / MARKER).read_text()) == LAYOUT
    except (OSError, ValueError):
        return False


def _write_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIAL)}
    vocab.update({f"w{i}": i + len(SPECIAL) for i in range(VOCAB_SIZE - len(SPECIAL))})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # words joined by spaces
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def _write_model(folder: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=MAX_POSITIONS,
        **SHAPE,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(str(folder), safe_serialization=True)


def write_tiny_model(out: Path) -> bool:
    """Write the model and tokenizer to ``out``; False when it already held them."""
    if is_written(out):
        return False
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _write_tokenizer(work)
        _write_model(work)
        (work / MARKER).write_text(json.dumps(LAYOUT, indent=2) + "\n")
        work.chmod(0o755)  # mkdtemp's folder is the user's alone
        if out.exists():  # an older or unfinished layout
            shutil.rmtree(out)
        os.replace(work, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the model folder to write")
    args = parser.parse_args(argv)
    try:
        wrote = write_tiny_model(args.out.expanduser().resolve())
    except KeyboardInterrupt:
        print("interrupted; nothing was written", file=sys.stderr)
        return 130
    print(f"{'wrote' if wrote else 'already written:'} {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
