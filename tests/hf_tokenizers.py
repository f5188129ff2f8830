"""Tokenizers of today's base models, trained here on a few KB of text (nothing downloaded), for the tests.

:func:`byte_level_bpe` builds a Llama-3-like ``tokenizers.Tokenizer``: Llama 3's split regex, a ByteLevel
pre-tokenizer and decoder, BPE; :data:`HARD` is the hard-string set ids are compared on.
"""

TEXT = ("The river flows past the old stone mill, number 12, and on to the sea.\n"
        "def flow(river):\n    return river.speed * 2  # metres per second\n"
        "Rivers\tand\tstreams\r\nmeet at the delta.\n") * 20
#: Whitespace runs, tabs, CRLF, emoji, CJK, combining marks, code, the empty string.
HARD = ["", " ", "   leading and trailing   ", "tabs\tand\t\tmore\t", "crlf\r\nline\r\n", "\n\n\nnewlines",
        "emoji 😀👍🏽 🧪", "日本語のテキスト 中文", "combining e\u0301 a\u0308 n\u0303", "zero\u200dwidth\u00a0nbsp",
        "def f(x):\n    return {'a': [1, 2]}  # code\n", "mixed   \t \r\n  whitespace", "ʻokina ǂ ŋ"]
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
#: Qwen2's: one digit at a time (its tokenizer.json also normalises to NFC).
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def byte_level_bpe(specials, *, bos_template=None, vocab_size=500, text=TEXT, split=LLAMA3_SPLIT, nfc=False):
    """A byte-level BPE ``tokenizers.Tokenizer`` of ``vocab_size`` ids, the ``specials`` first (ids 0, 1, ...);
    with ``bos_template`` (a special token) a post-processor that puts it before every text, as Llama 3's does;
    ``split``: the pre-tokenizer's regex; ``nfc``: an NFC normalizer (Qwen2's and Qwen3's tokenizers have one)."""
    import tokenizers
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers
    tok = tokenizers.Tokenizer(models.BPE(ignore_merges=True))
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                                        show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos_template:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos_template} $A", pair=f"{bos_template} $A {bos_template} $B",
            special_tokens=[(bos_template, tok.token_to_id(bos_template))])
    return tok
