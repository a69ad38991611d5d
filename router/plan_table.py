"""Human-readable rendering of a capacity :class:`~router.capacity.Plan`."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from router.capacity import LayoutPlan, Plan
from router.units import GB


def _rows(p: Plan) -> list[tuple[str, str, str]]:
    tp: LayoutPlan = p.layouts["tp"]
    dp: LayoutPlan = p.layouts["dp_ep"]

    def gb(v: float) -> str:
        return f"{v / GB:.1f} GB"

    return [
        ("KV pools (ranks)", f"{tp.ranks}", f"{dp.ranks}"),
        (
            "KV bytes/token held per GPU",
            f"{tp.kv_bytes_per_token_per_rank:,} B",
            f"{dp.kv_bytes_per_token_per_rank:,} B",
        ),
        ("weights per GPU", gb(tp.weights_bytes_per_gpu), gb(dp.weights_bytes_per_gpu)),
        ("KV memory per GPU", gb(tp.kv_bytes_per_gpu), gb(dp.kv_bytes_per_gpu)),
        ("KV tokens per rank", f"{tp.kv_tokens_per_rank:,}", f"{dp.kv_tokens_per_rank:,}"),
        ("KV tokens in total", f"{tp.kv_tokens_total:,}", f"{dp.kv_tokens_total:,}"),
        (f"sequences at {p.context_tokens:,} tokens", f"{tp.seqs_at_context:,}", f"{dp.seqs_at_context:,}"),
        (
            "  (pooled, if one could straddle ranks)",
            f"{tp.seqs_at_context_pooled:,}",
            f"{dp.seqs_at_context_pooled:,}",
        ),
        ("KV read per GPU per step", f"{tp.kv_read_ms_per_step:.2f} ms", f"{dp.kv_read_ms_per_step:.2f} ms"),
        (
            "attention weights read per step",
            f"{tp.attn_weight_read_ms_per_step:.2f} ms",
            f"{dp.attn_weight_read_ms_per_step:.2f} ms",
        ),
    ]


def render_plan(p: Plan, console: Console | None = None) -> None:
    console = console or Console()
    title = (
        f"{p.model} ({p.attention.upper()}, {p.kv_bytes_per_token:,} B/token {p.kv_dtype} KV) "
        f"on {p.gpus}x {p.gpu.upper()}, "
        f"{p.mem_fraction:.0%} usable, {p.weight_dtype} weights"
    )
    table = Table(title=title, title_justify="left")
    table.add_column("")
    table.add_column(f"TP={p.gpus}", justify="right")
    table.add_column(f"DP-attention + EP={p.gpus}", justify="right")
    for row in _rows(p):
        table.add_row(*row)
    console.print(table)
    console.print(
        f"capacity ratio dp_ep/tp: {p.capacity_ratio:.2f}x  ·  params {p.params_total / 1e9:.1f}B, "
        f"attention {p.attn_params_per_layer / 1e6:.1f}M per layer ({p.attn_weights_bytes_total / GB:.1f} GB)"
    )
