"""Searchers: what to try next, behind two verbs.

    point = searcher.ask()          # one new point (a dict of parameter values)
    searcher.tell(point, value)     # its objective (None: the trial failed)

A searcher's whole state is rebuilt by replaying ``ask`` counts and ``tell`` calls from the
journal: randomness is keyed by (seed, number of asks), never by hidden global state. A new
searcher is one small class registered in ``SEARCHERS``.

``gp`` is slow to ask (scikit-optimize refits a GP and optimises the acquisition), so the
coordinator never calls it inline: :class:`Prefetcher` computes suggestions ahead in a thread
and batches tells into one refit.
"""
from __future__ import annotations

import random
import threading
from typing import Any, Dict, List, Optional

import numpy as np

from .space import Space, trial_key


class Searcher:
    def __init__(self, space: Space, seed: int = 0, **options):
        self.space, self.seed = space, seed
        self.asked = 0

    def rng(self) -> np.random.Generator:
        return np.random.default_rng([self.seed, self.asked])

    def ask(self) -> Dict[str, Any]:
        raise NotImplementedError

    def tell(self, point: Dict[str, Any], value: Optional[float]) -> None:
        pass


class RandomSearcher(Searcher):
    def ask(self):
        point = self.space.sample(self.rng())
        self.asked += 1
        return point


class GPSearcher(Searcher):
    """scikit-optimize GP (EI or gp_hedge). Batches of suggestions for busy blocks come from
    one GP fit (top expected improvement, spread apart) instead of constant liar's refits."""

    def __init__(self, space, seed=0, acq_func="EI", n_initial=5, **options):
        super().__init__(space, seed)
        from skopt import Optimizer

        self.opt = Optimizer(space.skopt_dimensions(), base_estimator="GP", acq_func=acq_func,
                             n_initial_points=n_initial, random_state=seed,
                             acq_optimizer="sampling" if len(space.params) > 6 else "auto")
        self._xs: List[list] = []
        self._ys: List[float] = []

    def ask_many(self, n: int) -> List[Dict[str, Any]]:
        if n == 1 or not self.opt.models:  # one point, or still in the random initial phase
            xs = self.opt.ask(n_points=n, strategy="cl_min") if n > 1 else [self.opt.ask()]
        else:
            xs = self._batch(n)
        self.asked += len(xs)
        return [dict(zip(self.space.names, _plain(x))) for x in xs]

    def _batch(self, n: int, candidates: int = 4000, spread: float = 0.05):
        """n points from one fitted GP: the best expected-improvement candidates that lie at
        least ``spread`` apart (in the unit-scaled space). Constant liar would refit the GP
        once per point; this costs one acquisition evaluation for the whole batch."""
        from skopt.acquisition import _gaussian_acquisition

        space = self.opt.space
        cand = space.rvs(n_samples=candidates, random_state=int(self.rng().integers(2 ** 31)))
        X = space.transform(cand)
        acq = _gaussian_acquisition(X, self.opt.models[-1], y_opt=float(np.min(self.opt.yi)),
                                    acq_func="EI")
        picked: List[int] = []
        for i in np.argsort(acq):  # most negative = highest expected improvement
            if all(np.linalg.norm(X[i] - X[j]) / np.sqrt(X.shape[1]) >= spread for j in picked):
                picked.append(int(i))
            if len(picked) == n:
                break
        return [cand[i] for i in picked]

    def ask(self):
        return self.ask_many(1)[0]

    def tell_many(self, results) -> None:
        xs = [[r[0][n] for n in self.space.names] for r in results if r[1] is not None]
        ys = [float(r[1]) for r in results if r[1] is not None]
        if xs:
            self.opt.tell(xs, ys)  # one refit for the whole batch

    def tell(self, point, value):
        self.tell_many([(point, value)])


class EvolutionSearcher(Searcher):
    """Steady-state evolution with DEAP: every ask breeds one child from the best ``population``
    evaluated points (tournament selection, uniform crossover, Gaussian mutation on numeric
    genes and random reset on categorical ones), so no block waits for a generation."""

    def __init__(self, space, seed=0, population=12, tournament=3, crossover=0.7,
                 mutation_sigma=0.15, mutation_rate=0.3, **options):
        super().__init__(space, seed)
        self.population, self.tournament = population, tournament
        self.cxpb, self.sigma, self.indpb = crossover, mutation_sigma, mutation_rate
        self.pool: List[tuple] = []  # (genes, value) of evaluated points

    def ask(self):
        from deap import base, creator, tools

        if not hasattr(creator, "MpilearnFitness"):
            creator.create("MpilearnFitness", base.Fitness, weights=(-1.0,))
            creator.create("MpilearnIndividual", list, fitness=creator.MpilearnFitness)
        rng = self.rng()
        self.asked += 1
        if len(self.pool) < self.population:
            return self.space.sample(rng)
        random.seed(int(rng.integers(2 ** 31)))  # DEAP's operators use the random module
        best = sorted(self.pool, key=lambda gv: gv[1])[:self.population]
        parents = []
        for genes, value in best:
            ind = creator.MpilearnIndividual(genes)
            ind.fitness.values = (value,)
            parents.append(ind)
        a, b = [creator.MpilearnIndividual(list(p)) for p in tools.selTournament(parents, 2, self.tournament)]
        if random.random() < self.cxpb:
            tools.cxUniform(a, b, indpb=0.5)
        numeric = [i for i, p in enumerate(self.space.params) if p.type != "categorical"]
        if numeric:
            sub = [a[i] for i in numeric]
            tools.mutGaussian(sub, mu=0.0, sigma=self.sigma, indpb=self.indpb)
            for i, v in zip(numeric, sub):
                a[i] = v
        for i, p in enumerate(self.space.params):
            if p.type == "categorical" and random.random() < self.indpb:
                a[i] = random.random()
        return self.space.decode([min(max(g, 0.0), 1.0) for g in a])

    def tell(self, point, value):
        if value is not None:
            self.pool.append((self.space.encode(point), float(value)))


SEARCHERS = {"random": RandomSearcher, "gp": GPSearcher, "evolution": EvolutionSearcher}


ACQ_FUNCS = ("EI", "PI", "LCB", "gp_hedge")


def searcher_options(cls) -> List[str]:
    """The options a searcher class takes (its constructors' named parameters)."""
    import inspect

    names = []
    for klass in cls.__mro__:
        if "__init__" in vars(klass):
            for p in inspect.signature(klass.__init__).parameters.values():
                if p.kind == p.POSITIONAL_OR_KEYWORD and p.name not in ("self", "space", "seed"):
                    names.append(p.name)
    return sorted(set(names))


def make_searcher(name: str, space: Space, seed: int = 0, **options) -> Searcher:
    """A searcher from its name and ``search.options``; unknown options and values the
    library would reject later are bad input (exit 2) before any trial runs."""
    from ..comm import UsageError
    from ..train.checks import did_you_mean

    if name not in SEARCHERS:
        raise UsageError(f"unknown searcher '{name}' (choose one of {', '.join(SEARCHERS)})")
    known = searcher_options(SEARCHERS[name])
    for option in options:
        if option not in known:
            raise UsageError(f"search.options.{option}: not an option of the {name} searcher"
                             f"{did_you_mean(option, known)} (it takes: "
                             f"{', '.join(known) or 'none'})")
    if name == "gp" and options.get("acq_func", "EI") not in ACQ_FUNCS:
        raise UsageError(f"search.options.acq_func is {options['acq_func']!r}; choose one of "
                         f"{', '.join(ACQ_FUNCS)}")
    try:
        return SEARCHERS[name](space, seed, **options)
    except (ValueError, TypeError) as err:  # a value the library rejects
        raise UsageError(f"search.options for the {name} searcher: {err}") from None


def _plain(values):
    return [v.item() if hasattr(v, "item") else v for v in values]


class Prefetcher:
    """Keeps ``ahead`` suggestions ready; asks and tells run in a background thread.

    ``get()`` never blocks: with nothing ready (a GP still refitting) it returns a random
    point instead of letting a block idle. ``tell()`` queues a result; the thread applies all
    queued results in one refit before computing the next batch.
    """

    def __init__(self, searcher: Searcher, ahead: int, known_keys=()):
        self.searcher, self.ahead = searcher, max(1, ahead)
        self.ready: List[Dict[str, Any]] = []
        self.pending_tells: List[tuple] = []
        self.known = set(known_keys)
        self.fallbacks = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self.error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="mpilearn-searcher", daemon=True)
        self._thread.start()
        self._wake.set()

    def _run(self):
        try:
            while not self._stop:
                self._wake.wait()
                self._wake.clear()
                while not self._stop:
                    with self._lock:
                        tells, self.pending_tells = self.pending_tells, []
                        need = self.ahead - len(self.ready)
                    if tells:
                        if hasattr(self.searcher, "tell_many"):
                            self.searcher.tell_many(tells)
                        else:
                            for point, value in tells:
                                self.searcher.tell(point, value)
                    if need <= 0:
                        break
                    if hasattr(self.searcher, "ask_many"):
                        points = self.searcher.ask_many(need)
                    else:
                        points = [self.searcher.ask() for _ in range(need)]
                    with self._lock:
                        for p in points:
                            key = trial_key(p)
                            if key not in self.known:
                                self.known.add(key)
                                self.ready.append(p)
                    if not points:
                        break
        except BaseException as err:  # reported by the coordinator on its next get()
            self.error = err

    def get(self) -> Dict[str, Any]:
        if self.error is not None:
            raise self.error
        with self._lock:
            point = self.ready.pop(0) if self.ready else None
        self._wake.set()
        if point is None:
            self.fallbacks += 1
            rng = np.random.default_rng([self.searcher.seed, 10 ** 6 + self.fallbacks])
            for _ in range(100):
                point = self.searcher.space.sample(rng)
                if trial_key(point) not in self.known:
                    break
            with self._lock:
                self.known.add(trial_key(point))
        return point

    def tell(self, point, value) -> None:
        with self._lock:
            self.pending_tells.append((point, value))
        self._wake.set()

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=60)
