"""Writes a tiny llama-architecture GGUF model with random weights, for scripts/real-engine.

Why: no model can be downloaded on the project's machines, yet the real-engine run needs a
model that llama.cpp's `llama-server` loads, tokenizes chat prompts with and decodes from. The
weights are random: the answers are nonsense, but every cost the router cares about is real —
prompt tokens are evaluated layer by layer into a real KV cache, the prompt cache is reused or
not, and decoding takes time per token.

How:
- Vocabulary: a SentencePiece-style ("llama") vocabulary: <unk>, <s>, </s>, ChatML's
  <|im_start|> / <|im_end|> (control tokens), the 256 byte-fallback tokens, every printable
  ASCII character, and each word of words.py as one token "▁word" (with all its prefixes, which
  the SPM merge needs to reach it). So a prompt of N words costs about N tokens.
- A ChatML chat template, so `/v1/chat/completions` works.
- Generation only ever emits whole-word tokens (valid UTF-8, readable, never an end token):
  dimension 0 of the residual stream is held at a constant (set in the embeddings; row 0 of
  every projection into the stream is zero), and the output matrix gives that dimension a large
  positive weight for word tokens and a large negative one for all others. Answers therefore
  run to `max_tokens`, which keeps output lengths fixed.

Usage: python3 make_model.py OUT.gguf [--layers 4] [--embd 256] [--ff 512] [--heads 4]
       [--ctx 4096] [--seed 23]
Needs the `gguf` and `numpy` packages (scripts/real-engine installs them into its venv).
"""

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import words  # noqa: E402

try:
    import gguf
except ImportError:  # pragma: no cover - told to the user
    sys.exit("make_model.py: the `gguf` package is missing (pip install gguf)")

SPACE = "\u2581"  # SentencePiece's word-start marker
NORMAL, CONTROL, BYTE = 1, 3, 6
UNKNOWN = 2

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def vocabulary():
    """(tokens, scores, types, word_token_ids)."""
    tokens = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    types = [UNKNOWN, CONTROL, CONTROL, CONTROL, CONTROL]
    scores = [0.0] * len(tokens)
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        types.append(BYTE)
        scores.append(0.0)
    seen = set(tokens)

    def add(piece, score):
        if piece not in seen:
            seen.add(piece)
            tokens.append(piece)
            types.append(NORMAL)
            scores.append(score)

    add(SPACE, -1000.0)
    for c in range(33, 127):
        add(chr(c), -1000.0)
    word_ids = []
    for w in words.words():
        piece = SPACE + w
        # Every prefix must exist for the SPM bigram merge to reach the whole word; longer
        # pieces score higher so they win the merge order.
        for n in range(2, len(piece)):
            add(piece[:n], float(n) - 100.0)
        add(piece, float(len(piece)))
        word_ids.append(tokens.index(piece))
    return tokens, scores, types, word_ids


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--embd", type=int, default=256)
    ap.add_argument("--ff", type=int, default=512)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=23)
    a = ap.parse_args()
    if a.embd % a.heads:
        sys.exit("make_model.py: --embd must be a multiple of --heads")

    rng = np.random.default_rng(a.seed)
    tokens, scores, types, word_ids = vocabulary()
    n_vocab, d = len(tokens), a.embd

    def rand(*shape, std=0.02):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    w = gguf.GGUFWriter(a.out, "llama")
    w.add_name("computeflux-tiny-random")
    w.add_context_length(a.ctx)
    w.add_embedding_length(d)
    w.add_block_count(a.layers)
    w.add_feed_forward_length(a.ff)
    w.add_head_count(a.heads)
    w.add_head_count_kv(a.heads)
    w.add_rope_dimension_count(d // a.heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(0)  # all F32
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(4)  # <|im_end|>, never generated (see the module doc)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(CHATML)

    # Embeddings: random, with dimension 0 held at a constant (see the module doc).
    embd = rand(n_vocab, d, std=1.0)
    embd[:, 0] = 16.0
    w.add_tensor("token_embd.weight", embd)
    w.add_tensor("output_norm.weight", np.ones(d, dtype=np.float32))
    out = rand(n_vocab, d, std=0.05)
    out[:, 0] = -2.0
    out[word_ids, 0] = 2.0
    w.add_tensor("output.weight", out)
    for i in range(a.layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(d, dtype=np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(d, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v"):
            w.add_tensor(p + name + ".weight", rand(d, d, std=0.1))
        wo = rand(d, d, std=0.05)
        wo[0, :] = 0.0
        w.add_tensor(p + "attn_output.weight", wo)
        w.add_tensor(p + "ffn_gate.weight", rand(a.ff, d, std=0.1))
        w.add_tensor(p + "ffn_up.weight", rand(a.ff, d, std=0.1))
        down = rand(d, a.ff, std=0.05)
        down[0, :] = 0.0
        w.add_tensor(p + "ffn_down.weight", down)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    params = n_vocab * d * 2 + a.layers * (4 * d * d + 3 * d * a.ff + 2 * d) + d
    print(
        f"{os.path.basename(a.out)}: llama, {a.layers} layers, n_embd {d}, n_ff {a.ff}, {a.heads} heads, "
        f"vocab {n_vocab} ({len(word_ids)} word tokens), ctx {a.ctx}, {params / 1e6:.2f} M params, F32"
    )


if __name__ == "__main__":
    main()
