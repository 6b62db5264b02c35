"""Compiles from several threads at once (issue 12 item 8): torch's tracing runs under gac's trace
lock (frontends/torch_state.py), so every thread gets a correct program and the process stays
sound (a training run afterwards still gets every gradient). benchmarks/compile_threads.py runs
the 20-round version."""

from __future__ import annotations

import threading

import torch

import gac_torch

ROUNDS = 3


def _programs(n: int):
    """n different small models (different widths and ops), their inputs and exports."""
    out = []
    for i in range(n):
        torch.manual_seed(i)
        width = 6 + 3 * i
        act = [torch.nn.GELU(), torch.nn.SiLU(), torch.nn.Tanh(), torch.nn.Softplus()][i % 4]
        m = torch.nn.Sequential(torch.nn.Linear(5, width), act, torch.nn.Linear(width, 3),
                                torch.nn.LayerNorm(3)).eval()
        x = torch.randn(2 + i, 5, generator=torch.Generator().manual_seed(100 + i))
        out.append((m, x, torch.export.export(m, (x,))))
    return out


def compile_in_threads(programs, rounds: int) -> list[list[object]]:
    """Per round, per thread: True when its program matched eager, else the error."""
    results = []
    for _ in range(rounds):
        got: list[object] = [None] * len(programs)

        def work(i: int, got: list = got) -> None:
            m, x, ep = programs[i]
            try:
                compiled = gac_torch.compile(ep, target="cpu")
                with torch.no_grad():
                    got[i] = torch.allclose(compiled(x), m(x), rtol=1e-5, atol=1e-5)
            except Exception as e:  # noqa: BLE001 (reported per thread, asserted below)
                got[i] = f"{type(e).__name__}: {e}"

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(programs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results.append(got)
    return results


def test_four_threads_compile_four_programs():
    results = compile_in_threads(_programs(4), ROUNDS)
    assert all(r is True for got in results for r in got), results


def test_training_after_threaded_compiles_gets_every_gradient():
    compile_in_threads(_programs(4), 1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.GELU(), torch.nn.Linear(7, 2))
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
    ref = {n: g for n, g in zip([n for n, _ in model.named_parameters()],
                                torch.autograd.grad(model(x).square().sum(), list(model.parameters())),
                                strict=True)}
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="gac", options={"target": "cpu"})
    compiled(x).square().sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, ref[name], rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
