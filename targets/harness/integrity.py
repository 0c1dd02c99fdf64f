"""Static integrity scan of a candidate's source (design check 5, the parts readable from code):
it imports only ``targets.api`` from the contract, and it does not name the harness's metrics
(metrics come from the harness trace; a stack that computes or writes them is reporting its own)."""

from __future__ import annotations

import ast
from pathlib import Path

from targets.harness.accuracy import CheckResult

METRIC_NAMES = {"rollout_throughput", "tokens_per_s", "step_time_s", "timeout_ratio", "device_utilization", "mean_device_busy"}
ALLOWED_CONTRACT_MODULES = {"targets", "targets.api"}


def scan_stack(stack_dir: Path) -> CheckResult:
    reasons: list[str] = []
    for path in sorted((stack_dir / "stack").rglob("*.py")):
        where = path.relative_to(stack_dir)
        try:
            tree = ast.parse(path.read_text(), filename=str(path))
        except SyntaxError as error:
            reasons.append(f"{where}:{error.lineno}: syntax error: {error.msg}")
            continue
        for node in ast.walk(tree):
            modules: list[str] = []
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            for module in modules:
                if module.split(".")[0] == "targets" and module not in ALLOWED_CONTRACT_MODULES:
                    reasons.append(f"{where}:{node.lineno}: imports harness internals ({module}); only targets.api is public")
            if isinstance(node, ast.Constant) and node.value in METRIC_NAMES:
                reasons.append(f"{where}:{node.lineno}: names the harness metric {node.value!r}: a stack must not report its own metrics")
            if isinstance(node, ast.Name) and node.id in METRIC_NAMES:
                reasons.append(f"{where}:{node.lineno}: defines or uses {node.id!r}, a harness metric name: a stack must not report its own metrics")
    return CheckResult("integrity", not reasons, reasons, {})
