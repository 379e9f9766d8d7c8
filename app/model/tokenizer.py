"""A character-level tokenizer built in code (no download), in the Hugging Face format.

One token per character of a fixed alphabet (printable ASCII and newline) plus four special
tokens. It is built with the `tokenizers` library (a BPE model with an empty merge list splits
text into single characters) and wrapped as `transformers.PreTrainedTokenizerFast`, so that
`save_pretrained` writes tokenizer.json / tokenizer_config.json which stock
`AutoTokenizer.from_pretrained` (and SGLang, which uses it) load unchanged.

Encoding text with special tokens prepends `<bos>`, as the engine does when it tokenizes a
prompt; completions end with `<eos>`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, processors
from transformers import AutoTokenizer, PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]
# Fixed order: ids never depend on the data, so every checkpoint shares one vocabulary.
ALPHABET = ["\n"] + [chr(c) for c in range(32, 127)]
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
VOCAB_SIZE = len(SPECIAL_TOKENS) + len(ALPHABET)  # 100


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Build the character tokenizer.

    Returns:
        A PreTrainedTokenizerFast with ``vocab_size == VOCAB_SIZE`` (100): ids 0..3 are
        ``<pad>, <bos>, <eos>, <unk>``; ids 4.. are newline and printable ASCII (32..126) in
        code-point order. Characters outside the alphabet map to ``<unk>``.
    """
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + ALPHABET)}
    # No pre-tokenizer: the whole text is one "word", and BPE with no merges leaves one token
    # per character (spaces included).
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.add_special_tokens(SPECIAL_TOKENS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, BOS_ID)]
    )
    tok.decoder = decoders.Fuse()  # join characters without spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token=UNK,
        padding_side="left",  # generation pads prompts on the left
        model_max_length=512,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(out_dir: str | os.PathLike, tokenizer: PreTrainedTokenizerFast | None = None) -> None:
    """Write the tokenizer files (tokenizer.json, tokenizer_config.json, ...) into ``out_dir``.

    Files are written to a temporary directory beside ``out_dir`` and then moved in one by one
    with ``os.replace``, so a reader never sees a half-written file.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = tokenizer or build_tokenizer()
    tmp = Path(tempfile.mkdtemp(dir=out, prefix=".tokenizer-"))
    try:
        for name in tokenizer.save_pretrained(str(tmp)):
            src = Path(name)
            os.replace(src, out / src.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def load_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerFast:
    """Load a tokenizer saved by `save_tokenizer` (or any HF tokenizer dir) with AutoTokenizer.

    Raises:
        FileNotFoundError: ``path`` has no tokenizer.json.
    """
    if not (Path(path) / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{path}: no tokenizer.json (expected a saved tokenizer)")
    return AutoTokenizer.from_pretrained(str(path))
