"""The time model against published measurements: predicted and measured samples/s side by
side for every row of a measurements file, with the error, in one run; `--fit` refits the
profile's free constants on those rows first and prints them (to put in its YAML).

    python benchmarks/calibrate_profile.py                   # the a100 profile as shipped
    python benchmarks/calibrate_profile.py --fit             # refit its 4 free constants
    python benchmarks/calibrate_profile.py --csv OTHER.csv   # rows of the same columns

The rows are LiBai's single-axis A100 runs (benchmarks/measurements/, columns and shapes
in ../shared/measurements/README.md); `model_zoo.plan.calibration` plans each one with the
project's bert-large / gpt2-1024 config.
"""

import argparse
import statistics
import time

from model_zoo.plan import calibration
from model_zoo.plan.devices import load_profile


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="a100")
    parser.add_argument("--csv", default=calibration.MEASUREMENTS)
    parser.add_argument("--fit", action="store_true", help="refit the profile's free "
                                                           "constants on these rows")
    args = parser.parse_args()
    started = time.perf_counter()
    profile = load_profile(args.device)
    planned = calibration.plan_rows(calibration.read_rows(args.csv), args.device)
    print(f"planned {len(planned)} rows in {time.perf_counter() - started:.1f} s")
    if args.fit:
        values = calibration.fit(planned, profile, profile.fitted)
        print("fitted: " + ", ".join(f"{name} = {value:.4g}" for name, value in values.items()))
        profile = calibration.with_constants(profile, values)
    print(f"{'model':6} {'layers':>6} {'dp':>3} {'tp':>3} {'pp':>3} {'ac':>3} {'mb':>4} "
          f"{'gb':>5} {'devices':>7} {'measured':>9} {'predicted':>9} {'error':>7}")
    errors = calibration.errors(planned, profile)
    for (row, plan), error in zip(planned, errors):
        devices = int(row["nodes"]) * int(row["gpus_per_node"])
        print(f"{row['model']:6} {row['layers']:>6} {row['dp']:>3} {row['tp']:>3} "
              f"{row['pp']:>3} {row['recompute']:>3} {row['micro_batch']:>4} "
              f"{row['global_batch']:>5} {devices:>7} {float(row['samples_per_s']):>9.2f} "
              f"{calibration.predict(plan, profile):>9.2f} {100 * error:>+6.1f}%")
    absolute = [abs(e) for e in errors]
    print(f"samples/s error: median {100 * statistics.median(absolute):.1f}%, mean "
          f"{100 * statistics.mean(absolute):.1f}%, max {100 * max(absolute):.1f}% "
          f"over {len(errors)} rows")
    measured = [float(row["samples_per_s"]) for row, _ in planned]
    predicted = [calibration.predict(plan, profile) for _, plan in planned]
    print(f"Spearman rank correlation, all rows: "
          f"{calibration.spearman(measured, predicted):.3f}")
    for (model, devices), same in calibration.fastest_agree(planned, profile).items():
        print(f"  {model} on {devices} device{'s' if devices > 1 else ''}: the fastest "
              f"predicted is {'the fastest measured' if same else 'NOT the fastest measured'}")


if __name__ == "__main__":
    main()
