"""module.Carveout on the CPU: the attribute is set only where it differs from what the
function was last given (the driver call replaced by a recorder)."""

from __future__ import annotations

from types import SimpleNamespace

from kestrel_rt.cuda import module


def test_carveout_sets_each_function_once_per_value(monkeypatch):
    calls = []
    monkeypatch.setattr(module, "_set_attribute",
                        lambda fn, attr, value, what: calls.append(
                            (getattr(fn, "kernel", fn).ptr, attr, value)))
    c = module.Carveout()
    a, b = SimpleNamespace(ptr=11), SimpleNamespace(kernel=SimpleNamespace(ptr=22))
    c.apply(a)  # the default: nothing to set
    assert calls == []
    c.percent = 100
    c.apply(a)
    c.apply(a)
    c.apply(b)
    attr = module.PREFERRED_SHARED_MEMORY_CARVEOUT
    assert calls == [(11, attr, 100), (22, attr, 100)]
    c.percent = module.DEFAULT_CARVEOUT  # back to the driver's choice: reset what was set
    c.apply(a)
    c.apply(b)
    assert calls[2:] == [(11, attr, -1), (22, attr, -1)]
