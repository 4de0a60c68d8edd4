"""Where a grads-in-forward chunk spends its time: the three cuBLAS matmuls of one token chunk
of C tokens, timed alone, at the shapes of the fused linear loss (CUDA only).

# C tokens per chunk, H hidden, V vocabulary

Per chunk: logits [C, V] = h_c @ W.T; dH_c [C, H] = G_c @ W (K = V, a small output: run
plain, transposed, and split over the vocabulary into S batched slices summed in fp32); dW
[V, H] += G_c.T @ h_c (K = C, a large output read and written once per chunk: into a bf16 and
an fp32 accumulator; the bf16 one also as the library's two vocabulary halves and stored
transposed). The ``*_hT`` / ``*_gT`` rows are layout trials: the chunk's hidden rows and the
logits gradient stored transposed, so that cuBLAS sees other operand orders. Each time is the
median of CUDA-event-timed repeats; ``three_bf16_per_1k`` is reported per 1k tokens so that
chunk sizes compare directly (the full three matmuls over N tokens are N / 1k times it).

    python packages/vocab-parallel/bench/chunk_matmuls.py --chunks 256,384,512,768,1024,2048
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import torch

from train_testing.bench import event_median_ms
from vocab_parallel._fused_linear import accumulate_weight_grad_


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--chunks", default="256,384,512,768,1024,2048")
    parser.add_argument("--splits", default="2,4,8")
    parser.add_argument("--full-tokens", default="", help="also time linear_cross_entropy")
    parser.add_argument("--full-chunks", default="384,768,1024")
    parser.add_argument("--profile", default="", help="TOKENS:CHUNK,... kernel tables")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    v, h = args.vocab, args.hidden
    dt = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(v, h, device="cuda", dtype=dt, generator=gen) * 0.02
    acc16 = torch.randn(v, h, device="cuda", dtype=dt, generator=gen) * 1e-3
    acc32 = acc16.float()
    acc16_t = acc16.T.contiguous()
    rows = []
    for c in (int(x) for x in args.chunks.split(",")):
        hid = torch.randn(c, h, device="cuda", dtype=dt, generator=gen)
        grad = torch.randn(c, v, device="cuda", dtype=dt, generator=gen) * 1e-4
        dh = torch.empty(c, h, device="cuda", dtype=dt)
        row = {"chunk": c}
        row["logits"] = event_median_ms(lambda hid=hid: hid @ weight.T)
        row["dH"] = event_median_ms(lambda grad=grad, dh=dh: torch.mm(grad, weight, out=dh))
        # The same product as [H, C] = W.T @ G.T, then copied transposed into the rows (a
        # trial: cuBLAS tiles the [C, H] output, 96 tiles of 128 x 256 at C=768, differently).
        row["dH_transposed"] = event_median_ms(
            lambda grad=grad, dh=dh: dh.copy_(torch.mm(weight.T, grad.T).T)
        )
        for s in (int(x) for x in args.splits.split(",")):
            if v % s:
                continue
            w3 = weight.view(s, v // s, h)
            g3 = grad.view(c, s, v // s).transpose(0, 1)  # [S, C, V/S], no copy

            def split(g3=g3, w3=w3, dh=dh) -> None:
                part = torch.bmm(g3, w3, out_dtype=torch.float32)
                dh.copy_(part.sum(0))

            row[f"dH_split{s}"] = event_median_ms(split)
        row["dW_bf16"] = event_median_ms(lambda grad=grad, hid=hid: acc16.addmm_(grad.T, hid))
        row["dW_halves"] = event_median_ms(
            lambda grad=grad, hid=hid: accumulate_weight_grad_(acc16, grad, hid, halves=True)
        )
        # The accumulator stored transposed, [H, V] += h_c.T @ G_c (a trial: the result would
        # need one transposing copy at the end, ~0.5 ms at V=152k, H=4096).
        row["dW_transposed"] = event_median_ms(
            lambda grad=grad, hid=hid: acc16_t.addmm_(hid.T, grad)
        )
        row["dW_fp32"] = event_median_ms(
            lambda grad=grad, hid=hid: torch.addmm(
                acc32, grad.T, hid, out_dtype=torch.float32, out=acc32
            )
        )
        row["dW_plain"] = event_median_ms(lambda grad=grad, hid=hid: grad.T @ hid)
        # Trials of the operands' layouts (cuBLAS picks its kernel per layout): the chunk's
        # hidden rows transposed ([H, C], a 6 MB copy per chunk) so that both operands of the
        # accumulation have the tokens (its K) contiguous; and the logits gradient stored
        # transposed ([V, C], as the logits matmul W @ h_c.T would write it), for all three.
        hid_t = hid.T.contiguous()
        grad_t = grad.T.contiguous()
        row["dW_hT"] = event_median_ms(lambda grad=grad, hid_t=hid_t: acc16.addmm_(grad.T, hid_t.T))
        row["dW_gT"] = event_median_ms(lambda grad_t=grad_t, hid=hid: acc16.addmm_(grad_t, hid))
        row["dW_gT_hT"] = event_median_ms(
            lambda grad_t=grad_t, hid_t=hid_t: acc16.addmm_(grad_t, hid_t.T)
        )

        def gt_halves(grad_t=grad_t, hid=hid, hid_t=None) -> None:
            other = hid if hid_t is None else hid_t.T
            acc16.view(2, v // 2, h).baddbmm_(
                grad_t.view(2, v // 2, grad_t.shape[1]), other.unsqueeze(0).expand(2, -1, -1)
            )

        row["dW_gT_halves"] = event_median_ms(gt_halves)
        row["dW_gT_hT_halves"] = event_median_ms(partial(gt_halves, hid_t=hid_t))
        row["dH_gT"] = event_median_ms(
            lambda grad_t=grad_t, dh=dh: torch.mm(grad_t.T, weight, out=dh)
        )
        row["logits_T"] = event_median_ms(lambda hid=hid: torch.mm(weight, hid.T))
        del hid_t, grad_t
        k = 1024 / c
        best_dh = min(val for key, val in row.items() if key.startswith("dH"))
        row["three_bf16_per_1k"] = k * (row["logits"] + best_dh + row["dW_bf16"])
        rows.append(row)
        print(json.dumps({key: round(val, 4) for key, val in row.items()}), flush=True)
        del hid, grad, dh
    full = []
    if args.full_tokens:
        import vocab_parallel as vp

        for n in (int(x) for x in args.full_tokens.split(",")):
            hidden = torch.randn(n, h, device="cuda", dtype=dt, generator=gen).requires_grad_()
            w = weight.detach().requires_grad_()
            labels = torch.randint(0, v, (n,), device="cuda", generator=gen)
            for c in (int(x) for x in args.full_chunks.split(",")):

                def step(c=c, hidden=hidden, w=w, labels=labels) -> None:
                    hidden.grad = w.grad = None
                    vp.linear_cross_entropy(
                        hidden, w, labels, reduction="sum", chunk_size=c, fp32_weight_grad=False
                    ).backward()

                full.append({"tokens": n, "chunk": c, "ms": event_median_ms(step, repeats=5)})
                print(json.dumps(full[-1]), flush=True)
                if f"{n}:{c}" in args.profile.split(","):
                    from torch.profiler import ProfilerActivity, profile

                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        step()
                        torch.cuda.synchronize()
                    print(
                        prof.key_averages().table(
                            sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60
                        ),
                        flush=True,
                    )
                    # this folder's timeline summary (the script's folder is on sys.path)
                    from fused_linear_ab import gpu_timeline

                    print(json.dumps(gpu_timeline(prof), indent=1), flush=True)
            del hidden, w, labels
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "vocab": v,
                    "hidden": h,
                    "rows": rows,
                    "full": full,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
