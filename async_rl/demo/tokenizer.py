"""Character-level tokenizer for the copy-digits demo, built offline with ``tokenizers``.

One token per character of a tiny alphabet (digits, "=", "\\n", " ") plus a few
special tokens. It is laid out as a byte-level BPE with no merges, i.e. the
exact pipeline of transformers' ``Qwen2Tokenizer``: for ``model_type`` "qwen2",
transformers 5 ``AutoTokenizer`` ignores the saved tokenizer class and rebuilds
a ``Qwen2Tokenizer`` from the saved vocab (a WordLevel model would silently be
replaced, dropping " " and "\\n"). Matching that pipeline makes AutoTokenizer
and a plain ``tokenizers.Tokenizer.from_file`` encode identically (tested).
Characters outside the alphabet are dropped when encoding.
"""

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<|endoftext|>"
# Not used by the task, but verl picks its Qwen continuous-token builder for
# model_type "qwen2", which requires this token and a single-token "\n".
IM_END_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, EOS_TOKEN, IM_END_TOKEN]

# The generation prompt: the model answers right after it.
SEPARATOR = "="
CHARACTERS = list("0123456789") + [SEPARATOR, "\n", " "]

# Qwen2's pre-tokenization regex (transformers.models.qwen2.tokenization_qwen2).
_QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Messages are concatenated verbatim; assistant turns end with eos; the
# generation prompt is the separator. [user "1234"] -> "1234=".
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ message['content'] }}"
    "{%- if message['role'] == 'assistant' -%}{{ eos_token }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}" + SEPARATOR + "{%- endif -%}"
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode map used by ByteLevel."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            mapping[byte] = chr(byte)
        else:
            mapping[byte] = chr(256 + extra)
            extra += 1
    return mapping


_BYTE_TO_UNICODE = _bytes_to_unicode()


def build_tokenizer(model_max_length: int = 64, characters=CHARACTERS, chat_template: str = CHAT_TEMPLATE
                    ) -> PreTrainedTokenizerFast:
    """Return the demo tokenizer (vocab: special tokens, then one token per character of `characters`)."""
    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in characters:
        vocab[_BYTE_TO_UNICODE[ord(char)]] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False, byte_fallback=False))
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        additional_special_tokens=[IM_END_TOKEN],
        chat_template=chat_template,
        clean_up_tokenization_spaces=False,
        model_max_length=model_max_length,
        padding_side="left",
    )
