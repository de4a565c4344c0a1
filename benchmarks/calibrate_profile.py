"""The time model against published measurements: measured and predicted samples/s side by
side for every row of a profile's measurements, with the error, in one run, and the same
prediction made three ways the fit never saw: without the row's group (leave one group
out: the profile's free constants refitted on the other (model, devices) groups), from a
fit on the runs of one parallel axis (the runs of two or three axes predicted), and, for
the rows kept apart as checks (never fitted on), as shipped. `--fit` refits the profile's
free constants on its fitting rows first and prints them (to put in its YAML).

    python benchmarks/calibrate_profile.py                      # the a100 profile as shipped
    python benchmarks/calibrate_profile.py --device ascend910b  # the 910B, its checks too
    python benchmarks/calibrate_profile.py --fit                # refit its free constants
    python benchmarks/calibrate_profile.py --csv OTHER.csv      # rows of the same columns

The rows: LiBai's 42 published A100 runs, the published Ascend runs and MindFormers' own
LLaMA tables, kept apart as checks (model_zoo/cost/measurements/, its README says what
each file holds and how it was read); `model_zoo.cost.calibration` plans each one with its
family's shipped config.
"""

import argparse
import statistics
import time

from model_zoo.cost import calibration
from model_zoo.cost.devices import load_profile


def summary(name: str, errors: list, agree: dict = None) -> str:
    absolute = [abs(e) for e in errors if e is not None]
    if not absolute:
        return f"{name}: no row"
    fastest = (f"; the fastest layout predicted in {sum(agree.values())} of {len(agree)} "
               f"groups" if agree else "")
    return (f"{name}: median error {100 * statistics.median(absolute):.1f}%, mean "
            f"{100 * statistics.mean(absolute):.1f}%, max {100 * max(absolute):.1f}% over "
            f"{len(absolute)} rows{fastest}")


def percent(error) -> str:
    return "n/a" if error is None else f"{100 * error:+.1f}%"


def role(run, fitted_ids, plan) -> str:
    if run.check:
        return "check"
    if id(plan) in fitted_ids:
        return "fitted"
    return "not fitted" + ("" if run.exact else " (work not known)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="a100",
                        choices=sorted(calibration.DEVICE_MEASUREMENTS))
    parser.add_argument("--csv", nargs="+", help="measurements (default: the device's own, "
                                                 "model_zoo/cost/measurements/)")
    parser.add_argument("--fit", action="store_true", help="refit the profile's free "
                                                           "constants on these rows")
    args = parser.parse_args()
    started = time.perf_counter()
    profile = load_profile(args.device)
    planned = calibration.plan_rows(calibration.device_runs(args.device, args.csv))
    print(f"planned {len(planned)} rows in {time.perf_counter() - started:.1f} s")
    fitting = calibration.fitting_runs(planned, profile)
    if args.fit:
        values = calibration.fit(fitting, profile, profile.fitted)
        print("fitted: " + ", ".join(f"{name} = {value:.4g}" for name, value in values.items()))
        profile = calibration.with_constants(profile, values)
    errors = calibration.errors(planned, profile)
    held_out, held_out_agree, held_out_multi = calibration.leave_one_group_out(
        planned, profile, profile.fitted)
    one_axis, one_axis_agree = calibration.single_axis_fit(planned, profile, profile.fitted)
    fitted_ids = {id(plan) for _, plan in fitting}
    width = max(len(run.name) for run, _ in planned)
    print(f"{'run':{width}} {'dp x mp x pp':>12} {'measured':>9} {'predicted':>9} "
          f"{'error':>7} {'group out':>9} {'1-axis fit':>10}  (samples/s)")
    for (run, plan), error, other, single in zip(planned, errors, held_out, one_axis):
        print(f"{run.name:{width}} {run.layout:>12} {run.samples_per_s:>9.2f} "
              f"{calibration.predict(plan, profile):>9.2f} {100 * error:>+6.1f}% "
              f"{percent(other):>9} {percent(single):>10}  {role(run, fitted_ids, plan)}")
    print(f"fitted on {len(fitting)} of the {len(planned)} rows "
          f"({profile.fitted_on}: {', '.join(profile.fitted) or 'nothing'})")
    fitted_rows = [(run, plan) for run, plan in planned if id(plan) in fitted_ids]
    checks = [(run, plan) for run, plan in planned if run.check]
    print(summary("fitted rows", calibration.errors(fitted_rows, profile),
                  calibration.fastest_agree(fitted_rows, profile)))
    print(summary("leave one group out", [e for (run, _), e in zip(planned, held_out)
                                          if not run.check], held_out_agree))
    print(summary("runs of 2-3 axes, fitted on 1-axis runs", one_axis, one_axis_agree))
    if checks:
        print(summary("checks (never fitted on)", calibration.errors(checks, profile),
                      calibration.fastest_agree(checks, profile)))
    for name, rows in (("fitted rows", fitted_rows), ("checks", checks)):
        if len(rows) > 2:
            rank = calibration.spearman([run.samples_per_s for run, _ in rows],
                                        [calibration.predict(plan, profile) for _, plan in rows])
            print(f"Spearman rank correlation, {name}: {rank:.3f}")
    multi = [(run, plan) for run, plan in planned if calibration.axes(run) >= 2]
    print("the fastest of each group's layouts of 2-3 axes, as fitted / with the group left "
          "out of the fit / fitted on 1-axis runs:")
    for key, same in calibration.fastest_agree(multi, profile).items():
        print(f"  {key[0]} on {key[1]} devices: " + " / ".join(
            "n/a" if right is None else "right" if right else "WRONG"
            for right in (same, held_out_multi.get(key), one_axis_agree.get(key))))
    print(f"done in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
