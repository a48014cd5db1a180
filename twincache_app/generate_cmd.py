"""`twincache generate`: the same flags and the same JSON for both backends."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from twincache.checkpoint import load_config
from twincache.default_model import default_model_dir
from twincache.errors import InputError
from twincache.generation import CACHE_KINDS, GenerationResult, SamplingParams, parse_token_ids
from twincache.tokenizer import StreamDecoder, Tokenizer

BACKENDS = ("torch", "jax")
DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_PROMPT = "The ring buffer remembers"


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by every subcommand that runs a model."""
    parser.add_argument("--model", type=Path, help="HF Mistral checkpoint directory (default: the embedded tiny model)")
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help=f"prompt text (default: {DEFAULT_PROMPT!r})")
    prompt.add_argument("--prompt-ids", type=parse_ids, help="prompt as comma-separated token ids, e.g. 1,2,3")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--dtype", choices=DTYPES, default="float32")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate", help="generate text with either backend",
        description="Prefill, then decode token by token; text streams as it is decoded.")
    parser.add_argument("--backend", choices=BACKENDS, default="torch")
    parser.add_argument("--cache", choices=CACHE_KINDS,
                        help="KV cache (default: sliding_window when the config has a window, else static)")
    add_model_arguments(parser)
    parser.add_argument("--max-cache-len", type=int, help="cache capacity (default: prompt + max new tokens)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-compile", action="store_true",
                        help="torch: run decode eagerly instead of under torch.compile (JAX: ignored)")
    parser.add_argument("--stream", action="store_true",
                        help="jax: decode one jitted step at a time (the default without --json is the fused "
                             "lax.while_loop, which prints the text when it ends); torch always streams")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    parser.set_defaults(run=run)


def parse_ids(text: str) -> list[int]:
    try:
        return parse_token_ids(text, "--prompt-ids")
    except InputError as err:  # argparse replaces a ValueError's message with its own; this keeps ours
        raise argparse.ArgumentTypeError(str(err)) from None


def resolve_prompt(args: argparse.Namespace, model_dir: Path) -> tuple[list[int], Tokenizer | None]:
    """Prompt ids from --prompt-ids or by tokenizing --prompt; the tokenizer is None when the dir has none."""
    has_tokenizer = (model_dir / "tokenizer.json").is_file()
    tokenizer = Tokenizer.from_model_dir(model_dir) if has_tokenizer or args.prompt_ids is None else None
    if args.prompt_ids is not None:
        if not args.prompt_ids:
            raise InputError("--prompt-ids is empty; give at least one token id")
        return args.prompt_ids, tokenizer
    return tokenizer.encode(args.prompt if args.prompt is not None else DEFAULT_PROMPT), tokenizer


def run_backend(backend: str, model_dir: Path, dtype: str, prompt_ids: list[int], args: argparse.Namespace,
                on_token: object) -> GenerationResult:
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    if backend == "torch":
        import torch

        from torch_cache.generate import generate
        from torch_cache.model import Mistral

        device = "cuda" if torch.cuda.is_available() else "cpu"
        model = Mistral.from_pretrained(model_dir, getattr(torch, dtype), device)
        return generate(model, [prompt_ids], args.max_new_tokens, cache=args.cache, max_cache_len=args.max_cache_len,
                        sampling=sampling, compile=not args.no_compile, on_token=on_token)
    import jax.numpy as jnp

    from jax_cache.generate import generate as jax_generate
    from jax_cache.model import Mistral as JaxMistral

    model = JaxMistral.from_pretrained(model_dir, getattr(jnp, dtype))
    return jax_generate(model, [prompt_ids], args.max_new_tokens, cache=args.cache,
                        max_cache_len=args.max_cache_len, sampling=sampling, fused=on_token is None,
                        on_token=on_token)


def run(args: argparse.Namespace) -> int:
    model_dir = args.model if args.model is not None else default_model_dir()
    eos = load_config(model_dir).eos_token_id  # also fails on a bad directory or config before a framework loads
    prompt_ids, tokenizer = resolve_prompt(args, model_dir)
    streaming = not args.json and (args.backend == "torch" or args.stream)
    decoder = StreamDecoder(tokenizer) if tokenizer is not None and streaming else None

    def print_delta(row_tokens: list[int]) -> None:
        if decoder is not None and row_tokens[0] != eos:
            sys.stdout.write(decoder.push(row_tokens[0]))
            sys.stdout.flush()
        elif decoder is None:
            sys.stdout.write(f"{row_tokens[0]} ")
            sys.stdout.flush()

    result = run_backend(args.backend, model_dir, args.dtype, prompt_ids, args, print_delta if streaming else None)
    token_ids = result.token_ids[0]
    text = tokenizer.decode(token_ids) if tokenizer is not None else None
    if args.json:
        from twincache_app.cli import print_json

        print_json({
            "backend": args.backend, "cache": result.cache_kind, "model": str(model_dir), "dtype": args.dtype,
            "max_cache_len": result.max_cache_len, "prompt_ids": prompt_ids, "token_ids": token_ids, "text": text,
            "prefill_s": round(result.prefill_s, 6), "first_step_s": round(result.first_step_s, 6),
            "decode_tok_s": round(result.decode_tok_s, 2),
            "decode_steps": result.decode_steps,
        })
        return 0
    if decoder is not None:
        sys.stdout.write(decoder.flush())
    elif not streaming:
        sys.stdout.write(text if text is not None else " ".join(map(str, token_ids)))
    sys.stdout.write("\n")
    sys.stdout.flush()  # a closed pipe ends the run here, before the summary below
    print(f"[{args.backend} {result.cache_kind} cache: prefill {result.prefill_s * 1000:.1f} ms, "
          f"first step {result.first_step_s:.2f} s, decode {result.decode_tok_s:.1f} tok/s over "
          f"{result.decode_steps} steps]", file=sys.stderr)
    return 0
