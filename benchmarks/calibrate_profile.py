"""The time model against published measurements: measured and predicted samples/s side by
side for every row of a measurements file, with the error, in one run, and the same
prediction made without the row's group (leave one group out: the profile's free constants
refitted on the other (model, devices) groups, the group predicted); `--fit` refits the
profile's free constants on all rows first and prints them (to put in its YAML).

    python benchmarks/calibrate_profile.py                   # the a100 profile as shipped
    python benchmarks/calibrate_profile.py --fit             # refit its free constants
    python benchmarks/calibrate_profile.py --csv OTHER.csv   # rows of the same columns

The rows are LiBai's 42 published A100 runs (model_zoo/cost/measurements/libai_a100.csv,
columns and shapes in model_zoo/cost/measurements/README.md); `model_zoo.cost.calibration`
plans each one with the project's bert-large / gpt2-1024 config.
"""

import argparse
import statistics
import time

from model_zoo.cost import calibration
from model_zoo.cost.devices import load_profile


def summary(name: str, errors: list, agree: dict) -> str:
    absolute = [abs(e) for e in errors if e is not None]
    if not absolute:
        return f"{name}: no row"
    fastest = (f"; the fastest layout predicted in {sum(agree.values())} of {len(agree)} "
               f"groups" if agree else "")
    return (f"{name}: median error {100 * statistics.median(absolute):.1f}%, mean "
            f"{100 * statistics.mean(absolute):.1f}%, max {100 * max(absolute):.1f}% over "
            f"{len(absolute)} rows{fastest}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="a100",
                        choices=sorted(calibration.DEVICE_MEASUREMENTS))
    parser.add_argument("--csv", help="measurements (default: the device's own, "
                                      "model_zoo/cost/measurements/)")
    parser.add_argument("--fit", action="store_true", help="refit the profile's free "
                                                           "constants on these rows")
    args = parser.parse_args()
    started = time.perf_counter()
    profile = load_profile(args.device)
    runs = calibration.read_rows(args.csv or calibration.DEVICE_MEASUREMENTS[args.device])
    planned = calibration.plan_rows([run for run in runs if run.device == args.device])
    print(f"planned {len(planned)} rows in {time.perf_counter() - started:.1f} s")
    fitting = calibration.fitting_runs(planned, profile)
    if args.fit:
        values = calibration.fit(fitting, profile, profile.fitted)
        print("fitted: " + ", ".join(f"{name} = {value:.4g}" for name, value in values.items()))
        profile = calibration.with_constants(profile, values)
    errors = calibration.errors(planned, profile)
    held_out, held_out_agree = calibration.leave_one_group_out(planned, profile,
                                                               profile.fitted)
    width = max(len(run.name) for run, _ in planned)
    fitted_ids = {id(plan) for _, plan in fitting}
    print(f"{'run':{width}} {'dp x mp x pp':>12} {'measured':>9} {'predicted':>9} "
          f"{'error':>7} {'group out':>9}  (samples/s; 'check': not fitted on)")
    for (run, plan), error, other in zip(planned, errors, held_out):
        print(f"{run.name:{width}} {run.layout:>12} {run.samples_per_s:>9.2f} "
              f"{calibration.predict(plan, profile):>9.2f} {100 * error:>+6.1f}% "
              f"{'n/a' if other is None else f'{100 * other:+.1f}%':>9}"
              f"{'' if id(plan) in fitted_ids else '  check'}")
    agree = calibration.fastest_agree(planned, profile)
    print(f"fitted on {len(fitting)} of the {len(planned)} rows "
          f"({profile.fitted_on}: {', '.join(profile.fitted) or 'nothing'})")
    print(summary("all rows", errors, agree))
    print(summary("leave one group out", held_out, held_out_agree))
    measured = [run.samples_per_s for run, _ in planned]
    predicted = [calibration.predict(plan, profile) for _, plan in planned]
    print(f"Spearman rank correlation, all rows: "
          f"{calibration.spearman(measured, predicted):.3f}")
    for (model, devices), same in agree.items():
        held_out = held_out_agree.get((model, devices), True)
        print(f"  {model} on {devices} device{'s' if devices > 1 else ''}: the fastest "
              f"predicted is {'the fastest measured' if same else 'NOT the fastest measured'}"
              f"{'' if held_out else ' (NOT with the group left out)'}")
    print(f"done in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
