"""Write a tiny randomly-initialized model of a supported family as a Hugging Face folder, with
a real tokenizer (trained here on a built-in text) and a chat template, so kvmesh can be tried
on another model without downloading one:

    .venv/bin/python scripts/make_tiny_model.py /tmp/tiny-qwen2 --family qwen2
    kvmesh up --model /tmp/tiny-qwen2

Families: llama (Llama 3 style: byte-level BPE with Llama 3's split, optional --rope-scaling
llama3|linear|dynamic), qwen2 (byte-level BPE with Qwen2's split, q/k/v biases, tied embeddings),
mistral (SentencePiece-style BPE with byte fallback, a sliding window). The weights are random:
the output is gibberish, but every number and token id is the model's own. Needs `transformers`
(a test-only dependency of kvmesh). The tests build their models with the same functions.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

CORPUS = """\
The quick brown fox jumps over the lazy dog. A cache keeps what was computed, so that it is not
computed again. Serving a language model means turning prompts into tokens, tokens into keys and
values, and keys and values into the next token. In 2024 and 2025, 1,234 engines served 56,789
requests; each one answered in 0.25 seconds or less. Don't stop; it's fine, we'll see, they're here.
Qu'est-ce que c'est ? Ça va très bien, merci. Grüße aus Köln! Hello world, hello again, hello you.
def main():\n    return 42\n\nif __name__ == "__main__":\n    main()
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828. Symbols: #$%&*+-/<=>@[]^_{|}~ and emoji.
"""

SPECIALS = {
    "llama": ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
    "qwen2": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "mistral": ["<unk>", "<s>", "</s>"],
}
TEMPLATES = {
    "llama": ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
              "{{ m['content'] | trim }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}"
              "<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"),
    "qwen2": ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "mistral": ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} [/INST]"
                "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"),
}
# (bos, eos) per family, as the real models name them
SPECIAL_ROLES = {"llama": ("<|begin_of_text|>", "<|eot_id|>"), "qwen2": (None, "<|im_end|>"),
                 "mistral": ("<s>", "</s>")}
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def build_tokenizer(family: str, vocab_size: int = 400):
    """A `tokenizers.Tokenizer` shaped like the family's real one, trained on CORPUS."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer

    if family == "mistral":
        return _sentencepiece_style(vocab_size)
    tok = Tokenizer(models.BPE())
    if family == "qwen2":
        tok.normalizer = normalizers.NFC()
    split = LLAMA3_SPLIT if family == "llama" else QWEN2_SPLIT
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                         show_progress=False)
    tok.train_from_iterator(CORPUS.splitlines(), trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS[family]])
    if family == "llama":  # Llama 3 puts <|begin_of_text|> in front through its post-processor
        bos = SPECIAL_ROLES["llama"][0]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _sentencepiece_style(vocab_size: int):
    """Llama 2 / Mistral's shape: <unk> <s> </s>, the 256 <0xNN> byte pieces, then BPE pieces over
    '▁'-joined text, byte fallback for anything else (as their tokenizer.json)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers.trainers import BpeTrainer

    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    trained.train_from_iterator(CORPUS.splitlines(), BpeTrainer(vocab_size=vocab_size, show_progress=False))
    spec = json.loads(trained.to_str())["model"]
    pieces = sorted(spec["vocab"], key=spec["vocab"].get)
    vocab = {t: i for i, t in enumerate([*SPECIALS["mistral"], *(f"<0x{b:02X}>" for b in range(256)), *pieces])}
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in spec["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS["mistral"]])
    return tok


def hf_config(family: str, tok, *, rope_scaling: str | None = None, layers: int = 2,
              sliding_window: int | None = None, tie: bool | None = None, attention_bias: bool = False):
    """A transformers config of the family for tokenizer `tok`: GQA (4 query heads over 2 KV
    heads), head_dim 16."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=tok.get_vocab_size(with_added_tokens=True), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
                  initializer_range=0.2)
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if rope_scaling == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    elif rope_scaling == "linear":
        rope = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}
    elif rope_scaling == "dynamic":
        rope = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    elif rope_scaling is not None:
        raise ValueError(f"--rope-scaling {rope_scaling!r}: use llama3, linear or dynamic")
    # dynamic: 32 positions trained, so a 64-token prompt is at factor x the original context
    max_pos = 32 if rope_scaling == "dynamic" else 256
    bos, eos = (None if n is None else tok.token_to_id(n) for n in SPECIAL_ROLES[family])
    if family == "llama":
        return LlamaConfig(**common, max_position_embeddings=max_pos, rope_parameters=rope, bos_token_id=bos,
                           eos_token_id=eos, tie_word_embeddings=bool(tie), attention_bias=attention_bias)
    if attention_bias:
        raise ValueError("attention_bias is a llama-family option (Qwen2 always has q/k/v biases)")
    if rope_scaling is not None:
        raise ValueError("--rope-scaling is for the llama family")
    if family == "qwen2":
        return Qwen2Config(**common, max_position_embeddings=max_pos, rope_parameters=rope, bos_token_id=bos,
                           eos_token_id=eos, tie_word_embeddings=True if tie is None else tie,
                           use_sliding_window=sliding_window is not None, sliding_window=sliding_window,
                           max_window_layers=1)
    if family == "mistral":
        return MistralConfig(**common, max_position_embeddings=max_pos, rope_parameters=rope, bos_token_id=bos,
                             eos_token_id=eos, tie_word_embeddings=bool(tie),
                             sliding_window=8 if sliding_window is None else sliding_window)
    raise ValueError(f"--family {family!r}: use llama, qwen2 or mistral")


def make_model(folder: str | Path, family: str, *, seed: int = 0, rope_scaling: str | None = None,
               layers: int = 2, sliding_window: int | None = None, tie: bool | None = None,
               attention_bias: bool = False, template_file: bool = False):
    """Write the model to `folder` (config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json or chat_template.jinja); returns the transformers model (fp32, eval)."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(family)
    cfg = hf_config(family, tok, rope_scaling=rope_scaling, layers=layers, sliding_window=sliding_window, tie=tie,
                    attention_bias=attention_bias)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a bug in either cannot hide
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn_like(p))
    model.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    bos, eos = SPECIAL_ROLES[family]
    tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
               "clean_up_tokenization_spaces": False, "model_max_length": cfg.max_position_embeddings}
    if family == "mistral":
        tok_cfg["add_bos_token"] = True
    if template_file:
        (folder / "chat_template.jinja").write_text(TEMPLATES[family])
    else:
        tok_cfg["chat_template"] = TEMPLATES[family]
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
    return model


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", help="where to write the model (created)")
    p.add_argument("--family", default="qwen2", choices=("llama", "qwen2", "mistral"))
    p.add_argument("--rope-scaling", choices=("llama3", "linear", "dynamic"), help="llama family only")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    make_model(args.folder, args.family, seed=args.seed, rope_scaling=args.rope_scaling, layers=args.layers)
    print(f"wrote a tiny random {args.family} model to {args.folder}; serve it with: kvmesh up --model {args.folder}")


if __name__ == "__main__":
    main()
