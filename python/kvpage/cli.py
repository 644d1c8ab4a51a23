"""The ``kvpage`` command: generate, serve, bench, make-tiny-model.

    kvpage generate [MODEL_DIR | MODEL.gguf] --prompt "Hello" [--max-tokens 32]
    kvpage serve MODEL_DIR|MODEL.gguf [--host 127.0.0.1] [--port 8000] [--api-key KEY]
    kvpage make-tiny-model PATH

Engine flags are spelled as vLLM spells them. Without MODEL_DIR, ``generate``
uses the tiny trained Llama shipped inside the package (``kvpage/assets/default_model``).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from pathlib import Path


def _resolve_model(model: str | None) -> str:
    if model:
        return model
    from kvpage.assets import default_model_dir

    try:
        return str(default_model_dir())
    except FileNotFoundError as err:
        raise ValueError(str(err)) from None


def cmd_generate(args: argparse.Namespace) -> int:
    if args.warmup is None:
        args.warmup = "none"  # a one-off run compiles only the buckets it uses
    from kvpage.llm import LLM
    from kvpage.sampling.params import SamplingParams

    prompts = list(args.prompt or [])
    if args.prompts_file:
        prompts += [
            line.rstrip("\n")
            for line in Path(args.prompts_file).read_text().splitlines()
            if line.strip()
        ]
    if not prompts:
        print("error: give --prompt and/or --prompts-file", file=sys.stderr)
        return 2
    from kvpage.engine.config import engine_config_from_args

    config = engine_config_from_args(args, _resolve_model(args.model))
    llm = LLM(**{f.name: getattr(config, f.name) for f in fields(config)})
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        n=args.n,
        seed=args.sample_seed,
    )
    outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
    failed = 0
    for out in outputs:
        for completion in out.outputs:
            print(
                f"--- prompt: {out.prompt!r}  sample {completion.index} "
                f"({len(completion.token_ids)} tokens, {completion.finish_reason})"
            )
            print(out.prompt + completion.text)
            failed += completion.finish_reason == "error"
        if out.error is not None:
            print(f"error: prompt {out.prompt!r}: {out.error}", file=sys.stderr)
    # A sample the engine failed is not a result: a script must be able to tell.
    return 1 if failed else 0


def cmd_serve(args: argparse.Namespace) -> int:
    from kvpage.system.extras import SERVE_MODULES, require

    require("kvpage serve", SERVE_MODULES)  # before the model loads, not at the first request
    from kvpage.lora.request import LoRARequest
    from kvpage.openai.run import run_server

    if (args.replicas is not None or args.max_replicas is not None) and args.num_processes > 1:
        raise SystemExit("kvpage serve: --replicas (Ray) and --num-processes (one engine over "
                         "several processes) cannot be combined yet")
    if args.replicas is not None or args.max_replicas is not None:
        from kvpage.system.extras import RAY_MODULES

        require("kvpage serve --replicas", RAY_MODULES, extra="ray")
        if args.lora_modules or args.kv_events_config:
            raise SystemExit("kvpage serve --replicas: --lora-modules and --kv-events-config "
                             "are for one engine (no Ray) for now")
        from kvpage.ray.application import serve_on_ray

        args.replicas = args.replicas or 1
        serve_on_ray(args)
        return 0
    lockstep = args.num_processes > 1
    if lockstep:  # one engine over the devices of every process (kvpage.engine.lockstep)
        from kvpage.engine.lockstep import join_processes

        if not args.coordinator_address:
            raise SystemExit("--num-processes needs --coordinator-address HOST:PORT")
        join_processes(args.coordinator_address, args.num_processes, args.process_id)
        args.warmup = "none"  # every process must run the same programs in the same order
    if args.warmup is None:
        args.warmup = "background"  # serve at once; the other buckets compile meanwhile
    from kvpage.engine.config import engine_config_from_args

    config = engine_config_from_args(args, args.model)
    if lockstep and args.process_id != 0:
        from kvpage.engine.llm_engine import LLMEngine
        from kvpage.engine.lockstep import follow

        steps = follow(LLMEngine.from_config(config))
        print(f"process {args.process_id}: process 0 stopped after {steps} steps; exiting")
        return 0
    run_server(args.model, args.host, args.port, args.api_key, config,
               public_metrics=args.public_metrics or None,
               served_model_name=args.served_model_name, metrics_prefix=args.metrics_prefix,
               lora_modules=LoRARequest.parse_modules(args.lora_modules or []),
               lockstep=lockstep)
    return 0


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from kvpage.model.tiny_model import build_tiny_model

    print(build_tiny_model(args.path, seed=args.seed))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from kvpage.engine.config import add_engine_args
    from kvpage.serve_args import add_serve_args

    parser = argparse.ArgumentParser(
        prog="kvpage", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for prompts (offline)")
    gen.add_argument(
        "model",
        nargs="?",
        default=None,
        help="HF model directory or .gguf file (default: the tiny model shipped with kvpage)",
    )
    gen.add_argument("--prompt", action="append", help="a prompt; repeat for several")
    gen.add_argument("--prompts-file", help="a file with one prompt per line")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per sample")
    gen.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    gen.add_argument("--n", type=int, default=1, help="samples per prompt")
    gen.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate, max_model_len=None)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)

    try:
        from kvpage.bench import add_bench_parser
    except ImportError:  # the bench package is optional
        pass
    else:
        add_bench_parser(sub)

    tiny = sub.add_parser("make-tiny-model", help="write a tiny random Llama HF directory")
    tiny.add_argument("path", help="output directory")
    tiny.add_argument("--seed", type=int, default=0, help="weight seed")
    tiny.set_defaults(func=cmd_make_tiny_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the command itself, not a caller in this process
        from kvpage.system.huge_pages import reexec_with_huge_pages

        reexec_with_huge_pages(sys.argv[1:])  # before JAX is imported
    from kvpage.system.extras import MissingExtraError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, MissingExtraError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
