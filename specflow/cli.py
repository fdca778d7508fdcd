"""`specflow <command> [overrides]`: run | sim | plugins.

`run` and `sim` are Hydra apps: overrides such as `proposer=ngram policy=adaptive logits=[temperature]`
(a leading `+` is accepted too), `--cfg job` to print the composed config, `-m` for multirun, and
outputs under Hydra's run folder. Every user error prints one line and exits with status 2.
"""
from __future__ import annotations

import contextlib
import os
import sys
from typing import Callable

from specflow.errors import SpecflowError

USAGE = """usage: specflow <command> [overrides...]

commands:
  run       generate from prompts (prompt=..., prompt=- for stdin, or workload=...)
            e.g. specflow run proposer=ngram policy=adaptive prompt="def fib(n):"
  sim       the articles' formula tables on the synthetic pair (JSON + PNG + tables);
            studies=[policy_mix]: the policies on an interleaved code/chat mix
  calibrate load sweep with speculation on and off; writes policy/calibrated.yaml + a PNG
  train-head  self-distil an EAGLE-3 draft head for the target (proposer=eagle reads it):
            specflow train-head model=demo train_head.output=heads/demo
  head-data grow a head's data, kept as token ids (train-head reads it: train_head.sequences=):
            specflow head-data model=smollm2 head_data.folder=head_data/smollm2
  serve     an OpenAI-compatible server (pip install 'specflow[serve]'), e.g.
            specflow serve proposer=draft policy=goodput server.host=127.0.0.1 server.port=8000
  ab        an A/B experiment as a Hydra multirun: specflow ab experiment=demo_proposers
            (hydra/launcher=joblib for local processes; --quiet for CI logs)
  report    specflow report ab/<name> [--baseline old/report.json --max-acceptance-drop 0.05]
  plugins   list loaded plugins: name, package, version, hooks, components (--json)

Hydra options work after run, sim, calibrate, train-head, head-data, serve and ab: --cfg job, --help, hydra.run.dir=...
--quiet (run, sim, calibrate, train-head, head-data, ab, report): no progress bars or Hydra log lines, for CI logs
"""

# Hydra flags whose value is the next argument
_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--config-name", "-cn", "--config-dir",
                     "-cd", "--info", "-i", "--experimental-rerun"}


def fail(message: str, code: int = 2) -> int:
    """Print one line `specflow: error: ...` (after the traceback with SPECFLOW_TRACEBACK=1)."""
    from specflow.console import err_console

    if os.environ.get("SPECFLOW_TRACEBACK") == "1" and sys.exc_info()[1] is not None:
        import traceback
        traceback.print_exc()
    err_console.print(f"specflow: error: {message}", markup=False, highlight=False, soft_wrap=True)
    return code


def _overrides_only(args: list[str]) -> tuple[list[str], bool]:
    """The config overrides among Hydra's arguments, and whether this is a multirun."""
    out, skip, multirun = [], False, False
    for a in args:
        if skip:
            skip = False
            continue
        if a in ("-m", "--multirun"):
            multirun = True
        elif a.startswith("-"):
            skip = a in _FLAGS_WITH_VALUE
        elif not a.startswith(("hydra.", "hydra/", "+hydra", "~hydra")):
            out.append(a)
    return out, multirun


def _hydra_argv(prog: str, args: list[str], added: list[str]) -> list[str]:
    """Hydra's argv: its flags first, then the user's overrides and those specflow adds (the
    search path, the job name). Hydra's parser takes the overrides as one run of positionals, so
    one added after a flag (`specflow run proposer=ngram --cfg job`) would be refused as an
    argument the user never typed."""
    from specflow.config import with_searchpath

    flags, overrides, skip = [], [], False
    for a in args:
        if skip:                    # a flag's value
            flags.append(a)
            skip = False
        elif a.startswith("-"):
            flags.append(a)
            skip = a in _FLAGS_WITH_VALUE
        else:
            overrides.append(a)
    return [prog, *flags, *with_searchpath(overrides + added)]


def _hydra_app(task: Callable, config_name: str, command: str, args: list[str]) -> int:
    """Validate the overrides (exit 2 on a bad one), then hand over to hydra.main."""
    import hydra

    from specflow.config import compose, normalize_overrides

    quiet = "--quiet" in args
    args = normalize_overrides([a for a in args if a != "--quiet"])
    if quiet:             # CI logs: no progress bars, no Hydra log lines
        os.environ["SPECFLOW_QUIET"] = "1"
        args += ["hydra/job_logging=disabled", "hydra/hydra_logging=disabled"]
    overrides, multirun = _overrides_only(args)
    helping = any(a in ("--help", "-h", "--hydra-help") for a in args)
    if not multirun and not helping:
        compose(overrides, config_name)   # raises ConfigError -> exit 2
    sys.argv = _hydra_argv(f"specflow {command}", args, [f"hydra.job.name={command}"])
    main = hydra.main(version_base="1.3", config_path="pkg://specflow.conf",
                      config_name=config_name)(task)
    main()
    return 0


class RunFolderCheck:
    """Hydra callback (conf/config.yaml `hydra.callbacks`): before Hydra creates the run folder and
    writes into it, check it can be written and that no other process runs there; one line and
    exit 2 otherwise (Hydra would print a traceback for an unwritable folder)."""

    def on_run_start(self, config, **kwargs) -> None:
        from omegaconf import OmegaConf

        from specflow.io import check_folder_free

        folder = OmegaConf.select(config, "hydra.run.dir")
        if folder is None:
            return
        try:
            check_folder_free(str(folder),
                              f"specflow {OmegaConf.select(config, 'hydra.job.name') or 'run'}")
        except SpecflowError as exc:
            raise SystemExit(fail(str(exc))) from None

    def __getattr__(self, name: str):
        if name.startswith("on_"):    # Hydra's other callback hooks: nothing to do
            return lambda *args, **kwargs: None
        raise AttributeError(name)


# --- run -----------------------------------------------------------------------------------------

def run_task(cfg) -> None:
    from hydra.core.hydra_config import HydraConfig

    from specflow.app.folder_run import run_into
    from specflow.config import decode_escapes
    from specflow.console import console, metrics_table, print_results
    from specflow.pipeline import GenerationResult

    out = HydraConfig.get().runtime.output_dir
    quiet = os.environ.get("SPECFLOW_QUIET") == "1"
    rerun = f"rerun the same command with hydra.run.dir={out}"
    try:
        with interrupt_message(out, rerun):
            run = run_into(decode_escapes(cfg), out, owner="specflow run", setting="hydra.run.dir",
                           rerun=rerun, replace_finished=True,
                           progress=bool(cfg.show_progress) and console.is_terminal and not quiet)
    except SpecflowError as exc:
        raise SystemExit(fail(str(exc))) from None
    if not quiet:
        print_results([GenerationResult.from_json(r) for r in run.rows])
        console.print(metrics_table(run.stats))
    if run.chat and cfg.get("prompt") is not None:
        console.print(f"[dim]the prompt went in as a user turn of the model's chat template "
                      f"(chat={cfg.get('chat', 'auto')}; chat=off sends it as is)[/]")
    if run.resumed:
        console.print(f"[dim]resumed: {run.resumed} requests came from the interrupted run[/]")
    console.print(f"[dim]wrote {out}/requests.jsonl and {out}/metrics.json[/]")


@contextlib.contextmanager
def interrupt_message(out: str, rerun: str):
    """Ctrl-C: say where the finished requests are and how to resume, then exit 130."""
    try:
        yield
    except KeyboardInterrupt:
        from specflow.console import err_console
        err_console.print(f"specflow: interrupted; every finished request is kept in "
                          f"{out}/requests.jsonl: {rerun} to resume",
                          markup=False, highlight=False, soft_wrap=True)
        raise SystemExit(130) from None


# --- sim -----------------------------------------------------------------------------------------

def sim_task(cfg) -> None:
    import pathlib

    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf
    from rich.progress import Progress

    from specflow.console import console, sim_best_k_table, sim_k_table, sim_policy_table
    from specflow.experiments import plots, sim
    from specflow.io import atomic_write_json

    out = pathlib.Path(HydraConfig.get().runtime.output_dir)
    c = OmegaConf.to_container(cfg, resolve=True)
    rows, tokens = c["rows"], c["tokens"]
    try:
        with Progress(console=console, transient=True,
                      disable=os.environ.get("SPECFLOW_QUIET") == "1") as bar:
            task = bar.add_task("simulating arms", total=sim.count_arms(c))
            report = sim.run_studies(c, lambda: bar.advance(task))
    except SpecflowError as exc:
        raise SystemExit(fail(str(exc))) from None
    atomic_write_json(out / "sim.json", report)
    written = [out / "sim.json"]
    if "k_sweep" in report:
        console.print(sim_k_table(report["k_sweep"], f"K sweep (draft noise "
                                                     f"{c['k_sweep']['noise']}, {rows}x{tokens} tokens)"))
        written.append(plots.plot_k_sweep(report["k_sweep"], out / "k_sweep.png"))
    if "noise_sweep" in report:
        console.print(sim_k_table(report["noise_sweep"], f"noise sweep (k = {c['noise_sweep']['k']})"))
    if "best_k" in report:
        console.print(sim_best_k_table(report["best_k"]))
        written.append(plots.plot_best_k(report["best_k"], out / "best_k.png"))
    if "histogram" in report:
        written.append(plots.plot_histograms(report["histogram"], out / "tokens_per_round.png"))
    if "policy_mix" in report:
        for regime, rows_ in report["policy_mix"].items():
            console.print(sim_policy_table(rows_, f"policies on the code/chat mix: {regime} "
                                                  f"({c['policy_mix']['regimes'][regime]})"))
        written.append(plots.plot_policy_mix(report["policy_mix"], out / "policy_mix.png"))
    console.print("[dim]wrote " + ", ".join(str(p) for p in written) + "[/]")


# --- calibrate -----------------------------------------------------------------------------------

def calibrate_task(cfg) -> None:
    import pathlib

    from hydra.core.hydra_config import HydraConfig
    from rich.progress import Progress

    from specflow.app.prompts import read_prompts
    from specflow.config import decode_escapes, validate
    from specflow.console import calibrate_table, console
    from specflow.experiments import calibrate, plots
    from specflow.io import atomic_write_json

    refused = None
    try:
        cfg = validate(decode_escapes(cfg))
        prompts = read_prompts(cfg)
        cal = cfg.calibrate
        calibrate.check_settings(cal)
        sizes = sorted(int(b) for b in cal.batch_sizes)
        with Progress(console=console, transient=True,
                      disable=os.environ.get("SPECFLOW_QUIET") == "1") as bar:
            task = bar.add_task("load sweep (batch sizes x on/off x repetitions)", total=len(sizes))
            rows = calibrate.run_calibration(
                cfg, prompts, sizes, int(cal.new_tokens), lambda: bar.advance(task),
                repetitions=int(cal.get("repetitions", 3)),
                min_requests=int(cal.get("min_requests", 4)), warmup=int(cal.get("warmup", 1)))
        k = int(cfg.policy.get("k", cfg.policy.get("k_max", cfg.proposer.k)))
        source = f"{cfg.model.name} {cfg.model.get('path', '')}, proposer={cfg.proposer.name}"
        try:
            result = calibrate.write_calibrated(calibrate.calibrated_path(cal.output), rows, k,
                                                float(cal.margin), source,
                                                float(cal.get("tolerance", 0.05)))
        except calibrate.NoisyCalibration as exc:   # still show and keep what was measured
            refused = exc
            result = {"crossover": None, "crossover_from_medians": calibrate.crossover(rows),
                      "ranges": None, "path": None, "refused": str(exc)}
    except SpecflowError as exc:
        raise SystemExit(fail(str(exc))) from None
    out = pathlib.Path(HydraConfig.get().runtime.output_dir)
    atomic_write_json(out / "calibration.json", {"rows": rows, **result})
    png = plots.plot_calibration(rows, result["crossover"], out / "calibration.png")
    console.print(calibrate_table(rows, result, [calibrate.classify(r) for r in rows]))
    if refused is not None:
        console.print(f"[dim]wrote {out}/calibration.json, {png}; no policy written[/]")
        raise SystemExit(fail(str(refused)))
    console.print(f"[dim]wrote {result['path']} (use policy=calibrated), {out}/calibration.json, "
                  f"{png}[/]")


# --- train-head ----------------------------------------------------------------------------------

@contextlib.contextmanager
def _phases():
    """The long commands' progress: rich bars on a terminal, a plain line every 30 s off one
    (nohup, CI, a pipe), nothing under --quiet."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, \
        TimeRemainingColumn

    from specflow.app.progress import BarPhases, PlainPhases, silent, stderr_line
    from specflow.console import console

    if os.environ.get("SPECFLOW_QUIET") == "1":
        yield silent
    elif not console.is_terminal:
        yield PlainPhases(stderr_line)
    else:
        with Progress(TextColumn("{task.description}"), BarColumn(),
                      TextColumn("{task.completed}/{task.total}"),
                      TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                      TimeRemainingColumn(), console=console) as bar:
            yield BarPhases(bar)


def train_head_task(cfg) -> None:
    from specflow.app.prompts import read_prompts
    from specflow.config import decode_escapes, validate
    from specflow.console import console
    from specflow.training import train_head

    try:
        cfg = validate(decode_escapes(cfg))
        prompts = read_prompts(cfg)
        with _phases() as progress:
            summary = train_head.run(cfg, prompts, progress)
    except SpecflowError as exc:
        raise SystemExit(fail(str(exc))) from None
    fig = summary.get("heldout_greedy") or {}
    console.print(f"head: {summary['params'] / 1e6:.2f}M parameters, draft vocabulary covers "
                  f"{summary['draft_vocab_coverage']:.1%} of generated tokens; held-out greedy "
                  f"tau at k=4: {fig.get('tau', float('nan')):.2f}, acceptance by step "
                  f"{[round(a, 2) for a in fig.get('acceptance_by_step', [])]}")
    console.print(f"[dim]wrote {cfg.train_head.output} (config.json, model.safetensors); use "
                  f"proposer=eagle proposer.path={cfg.train_head.output}[/]")


def head_data_task(cfg) -> None:
    from specflow.config import decode_escapes, validate
    from specflow.console import console
    from specflow.training import head_data

    try:
        cfg = validate(decode_escapes(cfg))
        with _phases() as progress:
            manifest = head_data.grow(cfg, progress)
    except SpecflowError as exc:
        raise SystemExit(fail(str(exc))) from None
    parts = manifest["parts"]
    console.print(f"{cfg.head_data.folder}: {sum(p['sequences'] for p in parts)} sequences "
                  f"({sum(p['chat'] for p in parts)} chat, {sum(p.get('user', 0) for p in parts)} user), "
                  f"{sum(p['tokens'] for p in parts)} "
                  f"tokens ({sum(p['generated'] for p in parts)} target-written) in "
                  f"{len(parts)} parts")
    console.print(f"[dim]train a head on it: specflow train-head train_head.sequences="
                  f"{cfg.head_data.folder} train_head.output=...[/]")


# --- ab / report -----------------------------------------------------------------------------------

def cmd_ab(args: list[str]) -> int:
    """specflow ab experiment=NAME [overrides] [hydra/launcher=joblib] [--quiet]"""
    import hydra

    from specflow.config import compose, normalize_overrides
    from specflow.console import console
    from specflow.experiments import ab as ab_mod
    from specflow.io import folder_lock

    quiet = "--quiet" in args
    args = normalize_overrides([a for a in args if a != "--quiet"])
    overrides, _ = _overrides_only(args)
    cfg = compose(overrides)
    ab = ab_mod.check_experiment(cfg)
    if quiet:
        os.environ[ab_mod.QUIET_ENV] = "1"
    sweep_dir = next((a.split("=", 1)[1] for a in args if a.startswith("hydra.sweep.dir=")),
                     f"ab/{ab.name}")
    argv = [a for a in args if a not in ("-m", "--multirun")]
    if not any(a.startswith("hydra.sweep.dir=") for a in argv):
        argv.append(f"hydra.sweep.dir={sweep_dir}")
    quiet_logs = ["hydra/job_logging=disabled", "hydra/hydra_logging=disabled"] if quiet else []
    sys.argv = _hydra_argv("specflow ab", ["-m", *argv],
                           [*ab_mod.sweep_overrides(ab), "hydra.job.name=ab", *quiet_logs])
    # this command owns the sweep folder until every job is done (another `specflow ab` on it is
    # refused), and nothing runs when a job folder holds results of other overrides; each job
    # also holds its own folder (parallel launchers). A folder Hydra computes (${...}) is left to
    # the jobs.
    held = (contextlib.nullcontext() if "${" in sweep_dir
            else folder_lock(sweep_dir, "specflow ab", "hydra.sweep.dir"))
    with held:
        if "${" not in sweep_dir:
            ab_mod.check_sweep(cfg, overrides, sweep_dir)
        if not quiet:
            console.print(f"A/B {ab.name}: arms {', '.join(ab.arms)} x {ab.repetitions} "
                          f"repetition(s), baseline {ab.baseline} -> {sweep_dir}/")
        main = hydra.main(version_base="1.3", config_path="pkg://specflow.conf",
                          config_name="config")(ab_job_task)
        main()
    if not quiet:
        console.print(f"done: specflow report {sweep_dir}")
    return 0


def ab_job_task(cfg) -> None:
    """One (repetition, arm) job inside the Hydra multirun; a user error ends the sweep with one
    line and exit status 2 (not Hydra's multirun traceback)."""
    from hydra.core.hydra_config import HydraConfig

    from specflow.console import console
    from specflow.experiments import ab as ab_mod

    hc = HydraConfig.get()
    out = hc.runtime.output_dir
    label = f"{cfg.ab.name}: arm {cfg.ab.arm}, repetition {cfg.ab.rep}"
    quiet = os.environ.get(ab_mod.QUIET_ENV) == "1"

    def on_start(n_prompts: int) -> None:
        if not quiet:
            console.print(f"{label}: {n_prompts} prompts")

    try:
        with interrupt_message(out, "rerun the same command"):
            run = ab_mod.run_job(cfg, list(hc.overrides.task), out, on_start=on_start,
                                 progress=not quiet and console.is_terminal)
    except SpecflowError as exc:
        raise SystemExit(fail(f"{cfg.ab.name}, arm {cfg.ab.arm}, repetition {cfg.ab.rep}: "
                              f"{exc}")) from None
    if quiet:
        return
    if run.skipped:
        console.print(f"[dim]{label}: finished earlier, skipped[/]")
    else:
        s = run.stats
        console.print(f"[dim]{label}: {s['num_committed_tokens']} tokens, "
                      f"{s['tokens_per_second']:.1f} tokens/s, α {s['alpha']:.3f}[/]")


def cmd_report(args: list[str]) -> int:
    import argparse

    from specflow.experiments import report

    ap = argparse.ArgumentParser(prog="specflow report",
                                 description="Report an A/B sweep folder (report.md, plots, table)")
    ap.add_argument("folder")
    ap.add_argument("--baseline", help="an earlier report.json to check acceptance drift against")
    ap.add_argument("--max-acceptance-drop", type=float, default=0.05,
                    help="fail (exit 1) when an arm's α fell by more than this (default 0.05)")
    ap.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples for the CIs")
    ap.add_argument("--quiet", action="store_true", help="no table, one line per drift finding")
    try:
        opts = ap.parse_args(args)
    except SystemExit as exc:
        return 0 if exc.code == 0 else 2
    from specflow.console import console, err_console

    try:
        summary, drifted = report.write_report(opts.folder, opts.baseline, opts.bootstrap,
                                               opts.max_acceptance_drop)
    except SpecflowError as exc:
        return fail(str(exc))
    if not opts.quiet:
        console.print(report.table(summary))
        if report.repetition_table(summary) is not None:
            console.print(report.repetition_table(summary))
        console.print(f"[dim]wrote {opts.folder}/report.md, report.json and plots[/]")
    for line in drifted:
        err_console.print(f"specflow: drift: {line}", markup=False, highlight=False,
                          soft_wrap=True)
    return 1 if drifted else 0


# --- serve ---------------------------------------------------------------------------------------

def serve_task(cfg) -> None:
    from specflow.config import decode_escapes, validate
    from specflow.serving.app import serve

    try:
        serve(validate(decode_escapes(cfg)))
    except SpecflowError as exc:
        raise SystemExit(fail(str(exc))) from None


# --- plugins -------------------------------------------------------------------------------------

def cmd_plugins(args: list[str]) -> int:
    from rich.table import Table

    from specflow.console import console
    from specflow.hookspecs import HOOK_API_VERSION
    from specflow.plugins import plugin_distributions

    if args and args != ["--json"]:
        return fail(f"specflow plugins takes no arguments but --json (got {' '.join(args)})")
    rows = plugin_distributions()
    if args == ["--json"]:          # for scripts and CI
        import json
        print(json.dumps({"hook_api": HOOK_API_VERSION, "plugins": rows}, indent=2))
        return 0
    t = Table(title=f"specflow plugins (hook API {HOOK_API_VERSION})")
    for col in ("name", "package", "version", "hooks", "components"):
        t.add_column(col)
    for row in rows:
        t.add_row(row["name"], row["package"], row["version"], "\n".join(row["hooks"]),
                  "\n".join(row["components"]))
    console.print(t)
    return 0


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "run": lambda args: _hydra_app(run_task, "config", "run", args),
    "sim": lambda args: _hydra_app(sim_task, "sim", "sim", args),
    "calibrate": lambda args: _hydra_app(calibrate_task, "calibrate", "calibrate", args),
    "train-head": lambda args: _hydra_app(train_head_task, "train_head", "train-head", args),
    "head-data": lambda args: _hydra_app(head_data_task, "head_data", "head-data", args),
    "serve": lambda args: _hydra_app(serve_task, "serve", "serve", args),
    "ab": cmd_ab,
    "report": cmd_report,
    "plugins": cmd_plugins,
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0
    command, args = argv[0], argv[1:]
    if command not in COMMANDS:
        return fail(f"unknown command {command!r}; commands: {', '.join(COMMANDS)} "
                    f"(see specflow --help)")
    try:
        return COMMANDS[command](args) or 0
    except SpecflowError as exc:
        return fail(str(exc))
    except KeyboardInterrupt:
        return fail("interrupted", 130)


def entry() -> None:
    """The `specflow` console script: main(), and after a finished `specflow run` an exit
    without the interpreter's teardown, which takes about a second of a short run (unloading
    torch's and transformers' modules), once what the run wrote is flushed. Other commands
    (launchers with child processes, servers) exit as usual."""
    command = sys.argv[1:2]           # main() hands sys.argv to Hydra, which rewrites it
    code = main()
    if code == 0 and command == ["run"]:
        import logging

        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(0)
    sys.exit(code)


if __name__ == "__main__":
    entry()
