"""A plan as the text `rlhfkit plan` prints: phases and parts in GB, the verdict, the suggestions, the time."""

from __future__ import annotations

from rlhfkit.plan.devices import GB


def render(plan) -> str:
    """`plan` (a `rlhfkit.plan.Plan`) as a few aligned lines."""
    lines = [f"rlhfkit plan {plan.stage}: {plan.model}, {plan.processes} process(es)"
             + (f", {plan.sharding}" if plan.sharding != "none" else "")
             + (f", on {plan.device} ({plan.memory_gb:.1f} GB)" if plan.device else "")]
    for phase in plan.phases:
        lines.append(f"  {phase.name:<12} {phase.total / GB:9.3f} GB")
        for part, size in phase.parts.items():
            if size > 0:
                lines.append(f"    {part:<22} {size / GB:9.3f} GB")
    lines.append(f"  peak         {plan.peak_gb:9.3f} GB per process")
    if plan.fits is not None:
        lines.append(f"  verdict: {'fits' if plan.fits else 'does NOT fit'} {plan.device} ({plan.memory_gb:.1f} GB, "
                     f"with a 5% margin)")
    lines.append(f"  smallest device it fits on: {plan.smallest_device or 'none of the table (see suggestions)'}")
    if plan.seconds_per_step is not None:
        note = f" ({plan.time_basis})" if plan.time_measured else " (rates not measured on this device: a rough figure)"
        hours = f", {plan.hours:.2f} h for {plan.steps} steps" if plan.hours is not None else ""
        lines.append(f"  time: {plan.seconds_per_step:.3g} s/step{hours}{note}")
    if plan.suggestions:
        lines.append("  to lower the peak (each planned again):")
        for s in plan.suggestions:
            fits = "" if s.fits is None else " -> fits" if s.fits else ""
            lines.append(f"    -{s.saves_gb:.3f} GB to {s.peak_gb:.3f} GB{fits}: {s.text}")
    return "\n".join(lines)
