"""`python -m recipes.evaluate --model DIR --data DIR ...`: score a trained model (`recipes.evaluation.evaluate`);
`python -m recipes.evaluate harness --model DIR --tasks gsm8k,...`: lm-evaluation-harness tasks on it
(`recipes.evaluation.harness`); `python -m recipes.evaluate table RESULTS.json ...`: the Markdown table of
several runs, both kinds of results merged by run name (`recipes.evaluation.report`)."""

import sys

from recipes.evaluation.evaluate import main as evaluate_main
from recipes.evaluation.harness import main as harness_main
from recipes.evaluation.report import main as report_main


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "table":
        return report_main(argv)
    if argv and argv[0] == "harness":
        return harness_main(argv[1:])
    return evaluate_main(argv)


if __name__ == "__main__":
    sys.exit(main())
