"""The ``kvrouter`` command line: ``plan`` (capacity arithmetic) and ``serve`` (the gateway)."""

from __future__ import annotations

import sys
from typing import Annotated, NoReturn

import orjson
import typer

from router.capacity import CapacityError, PlanInputs, get_gpu, plan
from router.model import ModelConfigError, load_model
from router.plan_table import render_plan

app = typer.Typer(
    name="kvrouter",
    help="KV-aware router for MLA models served with data-parallel attention (SGLang, vLLM).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """Plan KV capacity (`kvrouter plan`) or run the gateway (`kvrouter serve`)."""


def fail(message: str, code: int = 2) -> NoReturn:
    """One clear line on stderr and a usage-error exit code; never a traceback."""
    sys.stderr.write(f"kvrouter: error: {message}\n")
    raise typer.Exit(code)


@app.command("plan")
def plan_command(
    model: Annotated[
        str, typer.Option(help="Preset (deepseek-v3, llama-3.3-70b) or path to an HF config.json.")
    ] = "deepseek-v3",
    gpu: Annotated[
        str, typer.Option(help="GPU type: h200 (141 GB, 4.8 TB/s), h100, h800, a100, b200.")
    ] = "h200",
    gpus: Annotated[int, typer.Option(help="GPUs in the node; also the DP size of the dp_ep layout.")] = 8,
    context: Annotated[
        int, typer.Option(help="Context length (tokens) for the sequences-per-node figures.")
    ] = 4096,
    kv_dtype: Annotated[
        str, typer.Option(help="KV cache dtype: bf16 or fp8 (fp8 halves bytes per token).")
    ] = "bf16",
    weight_dtype: Annotated[
        str, typer.Option(help="Weight dtype: fp8 (DeepSeek-V3 native) or bf16.")
    ] = "fp8",
    mem_fraction: Annotated[
        float, typer.Option(help="Share of GPU memory usable for weights + KV (the seed uses 0.92).")
    ] = 0.92,
    page_size: Annotated[
        int, typer.Option(help="KV page/block size; per-rank capacity rounds down to it.")
    ] = 1,
    json_out: Annotated[
        bool, typer.Option("--json", help="Print the plan as JSON instead of a table.")
    ] = False,
) -> None:
    """KV capacity of one node under TP attention and under DP attention + expert parallelism.

    Bytes per token come from the model architecture: MLA caches (kv_lora_rank + qk_rope_head_dim) x layers,
    undivided by TP; GQA caches 2 x kv_heads x head_dim x layers, divided by TP. GB are decimal (1e9 B).
    """
    try:
        arch = load_model(model)
        inputs = PlanInputs(
            gpu=get_gpu(gpu),
            gpus=gpus,
            context_tokens=context,
            kv_dtype=kv_dtype,
            weight_dtype=weight_dtype,
            mem_fraction=mem_fraction,
            page_size=page_size,
        )
        result = plan(arch, inputs)
    except (ModelConfigError, CapacityError, ValueError) as exc:
        fail(str(exc))
    if json_out:
        sys.stdout.write(orjson.dumps(result.to_json(), option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        render_plan(result)


def _register_serve() -> None:
    # Imported here: cmd_serve imports fail() from this module.
    from router.cmd_serve import serve_command

    app.command("serve")(serve_command)


_register_serve()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
