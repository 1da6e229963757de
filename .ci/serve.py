"""The newest CI job's serve check: a built cache served by a fresh process as a new replica would.

``python .ci/serve.py RECIPE CACHE WORKDIR`` runs tests/serving.py's ``serve_fresh`` (a fresh
interpreter in another folder, an empty Inductor cache and temp folder: eager reference first, then
``load_compiled(on_miss="error")`` and the recipe's warmup at every shape) and holds it to what every
strategy promises (``assert_served``: every entry a hit, 0 compiles by the strategy's own counter and
Inductor's, output within 1e-4 of eager, an unbuilt shape refused). It prints one line of figures.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.serving import assert_served, serve_fresh  # noqa: E402


def main(recipe: str, cache: str, workdir: str) -> None:
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    result = serve_fresh(Path(recipe).resolve(), Path(cache).resolve(), work)
    assert_served(result)
    print(f"served fresh: {result['hits']}/{result['shapes']} hits, {result['compiles']} compiles "
          f"({result['counter']}), image max diff {result['max_diff']:.2e} from eager, "
          f"denoiser max diff {result['component_max_diff']:.2e}")
    print(result["report"])


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit("usage: python .ci/serve.py RECIPE CACHE WORKDIR")
    main(*sys.argv[1:])
