"""The LLM judge: the deterministic gate decides first and is never overruled when it rejects; then
the model reviews the candidate for reward hacking and may only add a rejection.

The review gets what a careful human reviewer would want on one page: the task and its acceptance
criteria, the implementer's own account, the gate's checks with their details, the judged run's
figures against the parent's and the noise rule, a checklist of RL reward hacks that says which ones
the gate already rules out, the diff (``diff_page.py``: whole up to its limit, else file by file, folded
or left out with a note) and the files git ignores. It reads more through read-only tools and answers
with a ``Review`` through the tool loop's ``finish``.

When the review cannot be had (the provider fails past its retries, a CLI fails), the round keeps its
gated candidate: the gate's verdict stands with a passing ``llm_review`` check that says the review was
unavailable, unless the run requires the review (``--require-llm-review``): then the candidate is
rejected. A budget spent during the round (the implementer's last call crossed it) rejects the
candidate, kept under its rejected ref for a person to review: an implementer could otherwise spend the
rest of the budget to pass on the gate alone (the starter, which no agent wrote, is left to the gate);
the run stops at its budget check after the round. A
backend that refuses the run's configuration (401, 403, 404, a spent quota) is not such a failure:
``LLMUnusable`` propagates, and the run stops. A review that ran and reached no verdict (the model
stuck, out of turns, or answering outside its schema twice) rejects, and so does one whose request the
provider refused for what it held (``LLMRefused``: a diff past the model's window, text its filter
flags): the candidate's own text can cause either on purpose.
"""

from __future__ import annotations

import logging
from pathlib import Path

from agents.llm.agents import PROMPTS, OutputSchemaError, Review, answer
from agents.llm.client import ChatClient
from agents.llm.diff_page import Change, change_of
from agents.llm.errors import BudgetSpent, LLMRefused, LLMUnusable
from agents.llm.hacks import HACKS
from agents.llm.loop import StuckError, run_loop
from agents.llm.tools import Toolbox
from agents.offline.judge import first_of, ignored_files
from agents.roles import AgentError, RoundContext, Task, Verdict
from targets.harness.judge.check_result import CheckResult, detail
from targets.harness.measure.benchmark import SUMMARIZED
from targets.spec import TargetSpec

log = logging.getLogger("vibetrain.judge")

DETAILS_LIMIT = 800  # characters of one check's details in the prompt
ACCOUNT_LIMIT = 4_000  # characters of the implementer's account in the prompt
NAME_SHOWN = 200  # characters of one ignored file's name in the prompt
ACCOUNT_END = "</implementer-account>"  # the fence around it (judge.j2): its words are its claims, not the prompt's


def check_lines(checks: list[CheckResult]) -> list[str]:
    """Each check of the gate on one line: verdict, reasons, and its details (the margins it passed
    by), cut at ``DETAILS_LIMIT`` characters with a note."""
    lines = []
    for check in checks:
        line = f"{check.name}: {'pass' if check.passed else 'FAIL'}"
        line += "".join(f"; {reason}" for reason in check.reasons)
        details = check.details
        if details:
            text = ", ".join(f"{key}={detail(value)}" for key, value in details.items())
            if len(text) > DETAILS_LIMIT:
                text = text[:DETAILS_LIMIT] + f" [... {len(text) - DETAILS_LIMIT} more characters not shown]"
            line += f" (details: {text})"
        lines.append(line)
    return lines


def metric_lines(run, context: RoundContext | None, spec: TargetSpec | None) -> list[str]:
    """The judged run's figures, headline first, each against the parent's (with its spread), and
    the rule a change is measured by."""
    if run is None or not run.metrics:
        return ["(the gate's verdict carries no run figures)"]
    headline = spec.headline_metric.name if spec is not None else None
    names = [n for n in SUMMARIZED if isinstance(run.metrics.get(n), (int, float))]
    if headline in names:
        names = [headline] + [n for n in names if n != headline]
    parent = context.parent_metrics if context is not None else {}
    spread = context.parent_spread if context is not None else {}
    lines = []
    for name in names:
        value = run.metrics[name]
        line = f"- {name}: {value:.4g}"
        before = parent.get(name)
        if isinstance(before, (int, float)):
            noise = spread.get(name)
            line += f"; parent {before:.4g}" + (f" (spread {noise:.3g})" if isinstance(noise, (int, float)) else "")
            if before:
                line += f": {value / before - 1:+.1%}"
        if name == headline:
            better = "higher" if spec.headline_metric.direction == "maximize" else "lower"
            line += f" [the headline: {better} is better]"
        lines.append(line)
    if not parent:
        lines.append("(no parent figures: this is the run's first candidate, or the round was not given them)")
    if spec is not None:
        lines.append(
            f"A change counts only beyond the target's noise threshold of {spec.noise_threshold:.0%} on "
            f"{headline}. This is one run; the benchmark measures paired repeats next. A jump the change "
            "does not explain is a reason to read closely."
        )
    return lines


def reviewed(verdict: Verdict, passed: bool, reasons: list[str]) -> Verdict:
    """The gate's passing verdict with the ``llm_review`` check added: still passing (the gate's run
    kept, the review's remarks in the check), or rejected for ``reasons``."""
    return verdict.adding(CheckResult("llm_review", passed, reasons))


class LLMJudge:
    """The deterministic gate decides first; the model may only add a rejection. ``file_access``:
    False for a client that answers in text only (a coding-agent CLI's review), which then judges
    from the page alone. ``review_required``: a review that cannot be had rejects the candidate
    instead of leaving the decision to the gate."""

    def __init__(
        self,
        gate,
        client: ChatClient,
        *,
        spec: TargetSpec | None = None,
        review_required: bool = False,
        file_access: bool = True,
        max_turns: int = 20,
    ) -> None:
        self.gate, self.client, self.spec = gate, client, spec
        self.review_required, self.file_access, self.max_turns = review_required, file_access, max_turns

    def judge(
        self, workspace: Path, out: Path, task: Task | None = None, seed: int = 0, context: RoundContext | None = None
    ) -> Verdict:
        verdict = self.gate.judge(workspace, out, task, seed, context)
        if not verdict.passed:
            return verdict
        change = change_of(workspace)
        starter = task is not None and task.source == "starter"  # the library's own stack: no agent wrote it
        try:
            review = self.review(workspace, task, verdict, context, change)
        except LLMUnusable:
            raise  # a backend that refuses the run: the run stops, no outage to fall back from
        except BudgetSpent as error:  # crossed during this round: kept, for a person to review, but never
            # validated on the gate alone (an implementer could spend the rest of the budget to skip its review)
            if starter:
                return self.unavailable(verdict, error)
            reasons = [f"unreviewed: {error}; kept as rejected: a candidate is validated only after its review"]
            return reviewed(verdict, False, reasons)
        except (StuckError, OutputSchemaError, LLMRefused) as error:  # the model read the candidate and reached no
            # verdict, or the provider refused what the candidate put in the request: content can cause either on
            # purpose (a candidate built to derail its reviewer), so it rejects
            reasons = [f"reached no verdict: {type(error).__name__}: {error}"]
            return reviewed(verdict, False, reasons)
        except AgentError as error:  # the provider past its retries, a CLI that failed: an outage
            return self.unavailable(verdict, error)
        if review.verdict == "reject":
            reasons = list(review.reasons) or ["rejected without a reason"]
            return reviewed(verdict, False, reasons)
        if change.unseen and not self.file_access and not starter:  # accepted unread (the starter: 284 KB of kit)
            cause = f"incomplete: the diffs of {', '.join(first_of(change.unseen))} were not on its page"
            if self.review_required:
                return reviewed(
                    verdict, False, [f"{cause}; this run requires the review, so the candidate is rejected"]
                )
            return reviewed(verdict, True, [*review.reasons, f"{cause}; the deterministic gate decided for them"])
        return reviewed(verdict, True, review.reasons)

    def unavailable(self, verdict: Verdict, error: AgentError) -> Verdict:
        """The gate's verdict with the missing review recorded, or a rejection if the run requires it."""
        cause = f"unavailable: {type(error).__name__}: {error}"
        log.warning("%s", cause)
        if self.review_required:
            reasons = [f"{cause}; this run requires the review (--require-llm-review), so the candidate is rejected"]
            return reviewed(verdict, False, reasons)
        return reviewed(verdict, True, [f"{cause}; the deterministic gate decided"])

    def prompt(
        self, workspace: Path, task: Task | None, verdict: Verdict, context: RoundContext | None, change: Change
    ) -> str:
        note = change.note
        if note:
            note += (
                "read_file shows each file as the candidate has it (the parent's version is not in the workspace)."
                if self.file_access
                else "You cannot read the files here: a change you could not see is no reason to accept."
            )
        ignored = ignored_files(workspace)
        account = (context.account if context is not None else "") or "(the implementer gave no account)"
        if len(account) > ACCOUNT_LIMIT:  # the implementer sizes it: it must not crowd out the diff
            account = f"{account[:ACCOUNT_LIMIT]} ... (cut: the account is {len(account)} characters)"
        account = account.replace(ACCOUNT_END, "[account end]")  # it cannot close its fence and go on as the prompt
        # a file name may hold a line break (and a fake heading after it): such a one as a Python literal
        listed = ["(the workspace is not a git work tree)"]
        if ignored is not None:
            shown = [name if name.isprintable() else repr(name) for name in first_of(ignored)]
            # each cut: a red team's 50 names of 3,600 control characters, each a repr, filled 692k characters
            listed = [
                name if len(name) <= NAME_SHOWN else f"{name[:NAME_SHOWN]}... ({len(name)} characters)"
                for name in shown
            ]
        return PROMPTS.get_template("judge.j2").render(
            task=task or Task(id="unknown", title="(not given)", rationale=""),
            account=account,
            checks=check_lines(verdict.checks),
            metrics=metric_lines(verdict.run, context, self.spec),
            simulated=context.simulated if context is not None else False,
            hacks=HACKS,
            ignored=listed,
            diff=change.diff,
            diff_note=note,
            file_access=self.file_access,
        )

    def review(
        self, workspace: Path, task: Task | None, verdict: Verdict, context: RoundContext | None, change: Change
    ) -> Review:
        system = self.prompt(workspace, task, verdict, context, change)
        if not self.file_access:
            return answer(self.client, system, [{"role": "user", "content": "Review the change."}], Review, "judge")
        result = run_loop(
            self.client,
            system,
            [{"role": "user", "content": "Review the candidate: read what you need, then call finish."}],
            Toolbox(workspace, sandbox=None, writable=False),
            Review,
            finish_description="Your verdict. reasons: for a rejection, each names the file and the code that "
            "is the hack; for an acceptance, what you checked.",
            on_finish=_named_rejection,
            max_turns=self.max_turns,
            role="judge",
        )
        return result.output


def _named_rejection(review: Review) -> str | None:
    """A rejection must say why (the implementer's next attempt is told the reasons)."""
    if review.verdict == "reject" and not review.reasons:
        return "A rejection needs reasons: name the file and the code that is the hack."
    return None
