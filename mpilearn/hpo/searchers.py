"""Searchers: what to try next, behind two verbs.

    [(point, origin), ...] = searcher.ask_many(n, pending, exclude)
    searcher.tell_many([(point, loss), ...])   # loss minimised; None: no value (failed, pruned)

A searcher's whole state is rebuilt by replaying ``ask`` counts and ``tell`` calls from the
journal: randomness is keyed by (seed, number of asks), never by hidden global state. A new
searcher is one small class registered in ``SEARCHERS``.

Every suggestion has an origin: ``initial`` (the searcher's own opening points), ``model``
(from the fitted model or the evolved population), ``random``, ``enqueued`` (given by the
user) or ``fallback`` (handed out by the coordinator because the model had nothing ready).
``gp`` is slow to ask, so the coordinator never calls it inline: ``prefetch.Prefetcher``
computes suggestions in a thread and batches tells into one model update.
"""
from __future__ import annotations

import random
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from .space import KeyView, Space, trial_key


class Searcher:
    """``ask_many(n, pending, exclude)`` returns up to n ``(point, origin)`` pairs: ``pending``
    are points handed out but not yet told (busy blocks), ``exclude`` the keys never to return.
    Fewer than n means the searcher has nothing good to offer yet (the coordinator then hands
    out a fallback). ``tell_many`` takes ``(point, loss)`` pairs: loss minimised, a tuple for
    several objectives, None for a trial that gave no value."""

    max_objectives = 1

    def __init__(self, space: Space, seed: int = 0, n_objectives: int = 1):
        self.space, self.seed = space, seed
        self.asked = 0
        self.n_objectives = n_objectives

    def rng(self) -> np.random.Generator:
        return np.random.default_rng([self.seed, self.asked])

    def ask_many(self, n: int, pending=(), exclude=()) -> List[Tuple[Dict[str, Any], str]]:
        raise NotImplementedError

    def ask(self) -> Dict[str, Any]:
        got = self.ask_many(1)
        return got[0][0] if got else self.space.sample(self.rng())

    def tell_many(self, results) -> None:
        pass

    def tell(self, point: Dict[str, Any], value) -> None:
        self.tell_many([(point, value)])

    def _initial(self, n: int, exclude: set) -> List[Tuple[Dict[str, Any], str]]:
        """Up to n of the first ``self.n_initial`` random points (model-based searchers hand
        them out before their model takes over); their keys join ``exclude``."""
        out = []
        while len(out) < n and self.initial_handed < self.n_initial:
            point = self._fresh(exclude)
            if point is None:
                break
            self.initial_handed += 1
            exclude.add(trial_key(point))
            out.append((point, "initial"))
        return out

    def _fresh(self, exclude, tries: int = 100) -> Optional[Dict[str, Any]]:
        """A random point whose key is not excluded (None: none found)."""
        for _ in range(tries):
            point = self.space.sample(self.rng())
            self.asked += 1
            if trial_key(point) not in exclude:
                return point
        return None


class RandomSearcher(Searcher):
    def ask_many(self, n, pending=(), exclude=()):
        out = []
        exclude = KeyView(exclude)
        for _ in range(n):
            point = self._fresh(exclude)
            if point is None:
                break
            exclude.add(trial_key(point))
            out.append((point, "random"))
        return out


class GPSearcher(Searcher):
    """Bayesian optimisation with scikit-optimize's Gaussian process, built for many blocks.

    - ``n_initial`` random points are handed out first, whatever the number of blocks; the
      model takes over as soon as 2 results are in.
    - Batches are *kriging believer*: every busy block's point (and each point picked for
      this batch) joins the GP with the model's own prediction as its value, so n suggestions
      come from the latest model and spread out instead of piling up on one optimum.
    - Bounded cost: one model is kept (skopt's Optimizer keeps all of them); the kernel's
      hyperparameters are refitted each time n grows by 20 % (every result while n < 10), on at
      most ``max_fit_points`` points (the best half and the most recent half); otherwise the
      model is refitted with its kernel fixed (one Cholesky factorisation). Tells are batched:
      the fit happens at the next ask.
    - ``acq_func``: EI, PI or LCB; ``gp_hedge`` takes them in turn, one per suggestion (not
      skopt's gain-weighted portfolio).
    - At scale (more than ``believer_max`` points busy or asked for): the model is fitted on
      at most ``max_model_points`` results (the best half and the newest half), and a batch
      comes from that one model without refits, as DeepHyper's qUCB batches do (its
      decentralised search, Egele et al. 2023, gives each worker its own weight): each suggestion draws its own exploration weight
      kappa_i ~ Exp(mean ``kappa``) and minimises the lower confidence bound mu - kappa_i
      sigma, where sigma is shrunk near every busy point and every point already picked as
      one observation there would shrink it (sigma sqrt(1 - rho^2), rho the kernel's
      correlation). Cost per batch: one prediction on the candidates and one kernel column
      per busy or picked point, whatever the number of blocks.
    """

    def __init__(self, space, seed=0, n_objectives=1, acq_func="EI", n_initial=5, xi=0.01,
                 kappa=1.96, candidates=4000, max_fit_points=150, max_model_points=1000,
                 believer_max=16):
        super().__init__(space, seed, n_objectives)
        from skopt import Optimizer

        if n_initial < 1:
            raise ValueError(f"n_initial must be at least 1, got {n_initial}")
        # skopt's own setup: its normalised space and its GP (Matern 5/2 + noise, normalised y)
        template = Optimizer(space.skopt_dimensions(), base_estimator="GP", random_state=seed)
        self.sk_space, self.estimator = template.space, template.base_estimator_
        self.acq_func, self.xi, self.kappa = acq_func, xi, kappa
        self.n_initial, self.candidates, self.max_fit_points = n_initial, candidates, max_fit_points
        if max_model_points < max_fit_points:
            raise ValueError(f"max_model_points ({max_model_points}) must be at least "
                             f"max_fit_points ({max_fit_points})")
        self.max_model_points, self.believer_max = max_model_points, believer_max
        self.model_rows: List[int] = []  # which results the model is fitted on
        self.initial_handed = 0
        self.X: List[list] = []   # told points (skopt order of values)
        self.y: List[float] = []
        self.model = None         # the latest GP, fitted on X, y
        self.kernel = None        # its kernel (hyperparameters fitted at n_hyper points)
        self.n_hyper = 0
        self.fitted_n = 0

    # -- model ------------------------------------------------------------------------------
    def _row(self, point):
        return [point[n] for n in self.space.names]

    def _fit(self, Xt, y, kernel):
        """A GP on (Xt, y): hyperparameters fitted (``kernel`` None), or ``kernel``'s kept."""
        from sklearn.base import clone
        from sklearn.gaussian_process.kernels import Sum, WhiteKernel

        gp = clone(self.estimator)
        if kernel is not None:  # fixed: the signal part, the fitted noise as a fixed float
            signal = kernel.k1 if isinstance(kernel, Sum) and isinstance(kernel.k2, WhiteKernel) \
                else kernel
            gp.set_params(kernel=clone(signal), noise=max(self.noise, 1e-10), optimizer=None)
        with _quiet():
            gp.fit(Xt, y)
        return gp

    @staticmethod
    def _kept(y: np.ndarray, most: int) -> np.ndarray:
        """Indices of at most ``most`` results: the best half and the most recent half."""
        idx = np.arange(len(y))
        if len(y) <= most:
            return idx
        half = most // 2
        return np.unique(np.concatenate([np.argsort(y)[:half], idx[-half:]]))

    def _update(self):
        n = len(self.y)
        if n == self.fitted_n:
            return
        Xt = self.sk_space.transform(self.X)
        y = np.asarray(self.y, dtype=float)
        rows = self._kept(y, self.max_model_points)
        if self.kernel is None or n >= self.n_hyper + max(1, self.n_hyper // 5):
            idx = self._kept(y, self.max_fit_points)  # hyperparameters: best and newest
            gp = self._fit(Xt[idx], y[idx], None)
            self.kernel, self.noise, self.n_hyper = gp.kernel_, gp.noise_ or 0.0, n
            if len(idx) < len(rows):
                gp = self._fit(Xt[rows], y[rows], self.kernel)
        else:
            gp = self._fit(Xt[rows], y[rows], self.kernel)
        self.model, self.fitted_n, self.model_rows = gp, n, list(rows)

    @staticmethod
    def _mean_std(gp, Xt):
        """The GP's posterior mean and std, with BLAS matrix products (skopt's and sklearn's
        ``predict`` spend seconds in einsum at a thousand observations)."""
        K = gp.kernel_(Xt, gp.X_train_)
        mean = K @ gp.alpha_
        var = gp.kernel_.diag(Xt) - np.sum((K @ gp.K_inv_) * K, axis=1)
        std = np.sqrt(np.clip(var, 1e-12, None))
        return gp.y_train_std_ * mean.ravel() + gp.y_train_mean_, gp.y_train_std_ * std

    def _acquisition(self, gp, Xt, which: str, y_opt: float) -> np.ndarray:
        """Lower is better (skopt's conventions for EI, PI with ``xi`` and LCB with ``kappa``)."""
        from scipy.stats import norm

        mu, std = self._mean_std(gp, Xt)
        if which == "LCB":
            return mu - self.kappa * std
        gain = y_opt - mu - self.xi
        z = gain / std
        if which == "PI":
            return -norm.cdf(z)
        return -(gain * norm.cdf(z) + std * norm.pdf(z))

    def _candidates(self, rng, exclude):
        genes = rng.random((self.candidates, len(self.space.params)))
        if self.y:  # and a cloud around the best points so far: local refinement for free
            best = [self.space.encode(dict(zip(self.space.names, self.X[i])))
                    for i in np.argsort(self.y)[:5]]
            local = np.clip(np.repeat(best, 200, axis=0)
                            + rng.normal(0, 0.03, (200 * len(best), len(self.space.params))), 0, 1)
            genes = np.vstack([genes, local])
        points = [self.space.decode(g) for g in genes]
        unique = {}
        for p in points:
            key = trial_key(p)
            if key not in exclude:
                unique.setdefault(key, p)
        return list(unique.values())

    def _batch(self, n, pending, exclude):
        self._update()
        rng = self.rng()
        cand = self._candidates(rng, exclude)
        if not cand:
            return []
        Xc = self.sk_space.transform([self._row(p) for p in cand])
        if len(pending) + n > self.believer_max:
            return self._spread(n, pending, cand, Xc, rng)
        X, y = [self.X[i] for i in self.model_rows], [self.y[i] for i in self.model_rows]
        y_opt = float(np.min(self.y))
        gp = self.model
        if pending:  # busy blocks' points, believed at the model's prediction
            Xp = self.sk_space.transform([self._row(p) for p in pending])
            X += [self._row(p) for p in pending]
            y += list(self._mean_std(gp, Xp)[0])
            gp = self._fit(self.sk_space.transform(X), np.asarray(y), self.kernel)
        out, taken = [], np.zeros(len(cand), bool)
        for i in range(n):
            which = self.acq_func
            if which == "gp_hedge":
                which = ("EI", "PI", "LCB")[(self.asked + i) % 3]
            j = _pick(self._acquisition(gp, Xc, which, y_opt), taken)
            if j is None:
                break
            out.append(cand[j])
            if i + 1 < n:  # believe it, refit with the kernel fixed
                X.append(self._row(cand[j]))
                y.append(float(self._mean_std(gp, Xc[j:j + 1])[0][0]))
                gp = self._fit(self.sk_space.transform(X), np.asarray(y), self.kernel)
        return out

    def _spread(self, n, pending, cand, Xc, rng):
        """n suggestions from one model, each with its own exploration weight, kept apart
        from the busy points and from each other by the shrunk sigma (see the class)."""
        gp = self.model
        correlation = _correlation(gp.kernel_, Xc)
        mu, std = self._mean_std(gp, Xc)
        rho = np.zeros(len(cand))  # the highest correlation with a busy or picked point
        if pending:
            Xp = self.sk_space.transform([self._row(p) for p in pending])
            for chunk in np.array_split(Xp, -(-len(Xp) // 256)):
                rho = np.maximum(rho, correlation(chunk))
        kappas = rng.exponential(self.kappa, n)
        out, taken = [], np.zeros(len(cand), bool)
        for kappa in kappas:
            j = _pick(mu - kappa * std * np.sqrt(np.clip(1.0 - rho ** 2, 0.0, 1.0)), taken)
            if j is None:
                break
            out.append(cand[j])
            rho = np.maximum(rho, correlation(Xc[j:j + 1]))
        return out

    # -- the two verbs -----------------------------------------------------------------------
    def ask_many(self, n, pending=(), exclude=()):
        exclude = KeyView(exclude)
        out = self._initial(n, exclude)
        if len(out) < n and len(self.y) >= 2:
            points = self._batch(n - len(out), list(pending) + [p for p, _ in out], exclude)
            self.asked += len(points)
            out += [(p, "model") for p in points]
        return out

    def tell_many(self, results) -> None:
        for point, loss in results:
            if loss is not None:
                self.X.append(self._row(point))
                self.y.append(float(loss))


def _pick(score, taken):
    """The best (lowest-scoring) candidate not yet taken, now marked taken; None when every
    candidate is taken or scores non-finite."""
    score[taken] = np.inf
    j = int(np.argmin(score))
    if not np.isfinite(score[j]):
        return None
    taken[j] = True
    return j


def _correlation(kernel, Xc):
    """X -> per candidate c, the highest correlation k(c, x) / k(x, x) over the rows x of X.
    skopt's kernel (constant * Matern, + white noise) in closed form from the nearest row
    (sklearn's kernel call costs milliseconds per point); any other kernel through that call."""
    from scipy.spatial.distance import cdist
    from sklearn.gaussian_process.kernels import ConstantKernel, Matern, Product, Sum, WhiteKernel

    signal = kernel.k1 if isinstance(kernel, Sum) and isinstance(kernel.k2, WhiteKernel) else kernel
    matern = signal.k2 if isinstance(signal, Product) and isinstance(signal.k1, ConstantKernel) \
        else signal
    if isinstance(matern, Matern) and matern.nu in (0.5, 1.5, 2.5):
        scale = matern.length_scale
        scaled = Xc / scale

        def closed_form(X):
            r = cdist(scaled, X / scale).min(axis=1)  # Matern falls with the distance
            if matern.nu == 0.5:
                return np.exp(-r)
            if matern.nu == 1.5:
                return (1 + np.sqrt(3) * r) * np.exp(-np.sqrt(3) * r)
            return (1 + np.sqrt(5) * r + 5 * r ** 2 / 3) * np.exp(-np.sqrt(5) * r)

        return closed_form
    amplitude = float(signal.diag(Xc[:1])[0])
    return lambda X: signal(Xc, X).max(axis=1) / amplitude


class _quiet:
    """sklearn warns on every fit whose noise hits a bound; the search goes on regardless."""

    def __enter__(self):
        import warnings

        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("ignore")

    def __exit__(self, *exc):
        self._w.__exit__(*exc)


class ForestSearcher(Searcher):
    """Bayesian optimisation with an extra-trees surrogate, built for thousands of blocks
    (DeepHyper's decentralised search, Egele et al. 2023, is the anchor: a forest, and a UCB
    whose exploration weight each suggestion draws for itself).

    - ``n_initial`` random points are handed out first, whatever the number of blocks; the
      model takes over as soon as 2 results are in.
    - The surrogate: ``trees`` extremely randomised trees (scikit-learn's ExtraTrees, leaves
      of at least ``min_leaf`` results) on every result, or on ``max_fit_points`` of them (the best
      half and the newest half) past that; mean and spread over the trees. A fit costs
      0.3 s at 10 000 results and grows as n log n, not as n^3: no limit is needed below
      tens of thousands of results.
    - Off the critical path: with ``background`` the model is refitted in its own thread as
      results arrive (the next fit starts when one ends, on everything told by then), and an
      ask uses the newest finished model without waiting for the one being fitted. Only the
      first model is fitted inline. (The coordinator's prefetcher already keeps asks off the
      coordinator's loop; this keeps fits off the asks.) After each fit the thread rests so
      that fits take at most ``fit_share`` of its time: refitting back to back took a whole
      core, and at 4 096 real-time workers on 2 cores the blocks then waited for their
      answers (97.8 % busy, the GP 99.5 %).
    - Each suggestion draws its own exploration weight kappa_i ~ Exp(mean ``kappa``) and its
      own half of the trees (a bootstrap of the ensemble: a cheap posterior sample), and
      takes the candidate minimising mu_i - kappa_i sigma_i; a taken candidate is not taken
      twice. Batches stay diverse without believed points: the draws differ, not the model.
    - Candidates: ``candidates`` uniform points and as many around ``top`` centres, Gaussian
      steps of a scale drawn per candidate log-uniformly between ``local_scale`` / 100 and
      ``local_scale``: a trust region of every size at once, refined as far as the model can
      tell points apart. The centres are the best results by the model's mean (not the noisy
      values), each at least ``niche`` sqrt(d) from every better one: local search goes on in
      several basins at once. Without it (``niche`` 0) the centres all sat in the basin found
      first: at 4 096 simulated workers on Hartmann-6 the search ended in the second basin
      (regret 0.12, as the GP's 0.13); with 0.1, at 0.0033, with 0.2 and 40 centres at
      0.0008 (one seed, virtual time: ``bench/hpo_virtual.py``). At 1 024 workers over 7
      seeds: median 0.019, none above 0.042 (0.1 with 20 centres: median 0.041, two at
      0.12-0.14); the GP's median there is 0.0032: it refines one basin more finely.
    Cost per batch: one prediction of every tree on the candidates, whatever the number of
    blocks, busy points or results.
    """

    def __init__(self, space, seed=0, n_objectives=1, n_initial=5, kappa=1.96, trees=32,
                 min_leaf=1, candidates=2000, local_scale=0.2, top=40, niche=0.2,
                 max_fit_points=20000, background=True, failures="ignore", fit_share=0.25):
        super().__init__(space, seed, n_objectives)
        # imported here, before the sweep starts (seconds on a loaded node): at the first
        # fit, every block asking meanwhile would get a fallback
        from sklearn.ensemble import ExtraTreesRegressor

        self._forest_class = ExtraTreesRegressor
        if n_initial < 1:
            raise ValueError(f"n_initial must be at least 1, got {n_initial}")
        if trees < 2:
            raise ValueError(f"trees must be at least 2 (the spread over trees is the "
                             f"model's uncertainty), got {trees}")
        if min(kappa, niche) < 0 or not 0 < local_scale <= 1:
            raise ValueError(f"kappa and niche must be >= 0 and local_scale in (0, 1], got "
                             f"kappa {kappa}, niche {niche}, local_scale {local_scale}")
        if not 0 < fit_share <= 1:
            raise ValueError(f"fit_share must be in (0, 1], got {fit_share}")
        if min(min_leaf, candidates, top) < 1 or max_fit_points < 2:
            raise ValueError("min_leaf, candidates and top must be at least 1, "
                             "max_fit_points at least 2")
        self.n_initial, self.kappa, self.trees, self.min_leaf = n_initial, kappa, trees, min_leaf
        self.candidates, self.local_scale, self.top = candidates, local_scale, top
        if failures not in ("worst", "ignore"):
            raise ValueError(f"failures must be 'worst' or 'ignore', got {failures!r}")
        self.niche, self.failures = niche, failures
        self.max_fit_points, self.background = max_fit_points, background
        self.fit_share = fit_share
        self.initial_handed = 0
        self.X: List[list] = []   # told points, encoded in [0, 1]
        self.y: List[float] = []  # NaN: a failed trial
        self.succeeded = 0
        self.model = None         # the newest finished forest and the results it saw
        self.fitted_n = 0
        self._lock = threading.Lock()
        self._fitter: Optional[threading.Thread] = None
        self.error: Optional[BaseException] = None
        self.fits = 0

    # -- model ------------------------------------------------------------------------------
    def _fit_now(self):
        """A forest on the results told so far (or ``max_fit_points`` of them)."""
        with self._lock:
            n = len(self.y)
            X, y = np.asarray(self.X[:n], dtype=float), np.asarray(self.y[:n], dtype=float)
        failed = np.isnan(y)
        if failed.any() and self.failures == "ignore":
            X, y = X[~failed], y[~failed]
        elif failed.any():  # a failed trial counts as the worst result yet (DeepHyper's "min")
            y[failed] = np.max(y[~failed])
        rows = GPSearcher._kept(y, self.max_fit_points)
        forest = self._forest_class(n_estimators=self.trees, min_samples_leaf=self.min_leaf,
                                    max_features=1.0, n_jobs=1,
                                    random_state=int(np.random.default_rng(
                                        [self.seed, 3, n]).integers(2 ** 31)))
        forest.fit(X[rows], y[rows])
        centres = self._centres(X[rows], self._per_tree(forest, X[rows]).mean(axis=0))
        with self._lock:
            if n > self.fitted_n:
                self.model, self.fitted_n = (forest, centres), n
                self.fits += 1

    def _centres(self, X, mean):
        """The candidates' centres: the best results by the model's mean (not a lucky noisy
        value), each at least ``niche`` sqrt(d) from the better ones, so that local search
        goes on in several basins, not only in the best one found so far."""
        radius = self.niche * np.sqrt(X.shape[1])
        order = np.argsort(mean)
        chosen = [order[0]]
        for i in order[1:2000]:
            if len(chosen) >= self.top:
                break
            if np.min(np.linalg.norm(X[chosen] - X[i], axis=1)) >= radius:
                chosen.append(i)
        return X[chosen]

    def _fit_loop(self):
        try:
            while True:
                with self._lock:
                    if len(self.y) <= self.fitted_n:
                        self._fitter = None
                        return
                started = time.monotonic()
                self._fit_now()
                time.sleep((time.monotonic() - started) * (1 / self.fit_share - 1))
        except BaseException as err:  # raised by the next ask (the coordinator reports it)
            with self._lock:
                self._fitter, self.error = None, err

    def _refresh(self):
        """The newest model: fitted inline when there is none; else a refit is started in
        the background (or done inline without ``background``) when results are new."""
        if self.model is None or not self.background:
            if len(self.y) > self.fitted_n:
                self._fit_now()
            return
        with self._lock:
            if self._fitter is not None or len(self.y) <= self.fitted_n:
                return
            self._fitter = threading.Thread(target=self._fit_loop, daemon=True,
                                            name="mpilearn-forest-fit")
            self._fitter.start()

    def wait_fitted(self, timeout: float = 60.0) -> None:
        """Until the background fit has seen every result told (tests, benchmarks)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._refresh()
            with self._lock:
                if self._fitter is None and self.fitted_n == len(self.y):
                    return
            time.sleep(0.005)

    @staticmethod
    def _per_tree(forest, X):
        return np.stack([tree.predict(X) for tree in forest.estimators_])

    def _candidates(self, rng, best):
        d = len(self.space.params)
        genes = [rng.random((self.candidates, d))]
        centres = best[np.minimum(rng.geometric(0.2, self.candidates) - 1, len(best) - 1)]
        scale = self.local_scale * 10 ** rng.uniform(-2, 0, (self.candidates, 1))
        genes.append(np.clip(centres + scale * rng.normal(size=(self.candidates, d)), 0, 1))
        return np.vstack(genes)

    # -- the two verbs -----------------------------------------------------------------------
    def ask_many(self, n, pending=(), exclude=()):
        exclude = KeyView(exclude)
        out = self._initial(n, exclude)
        if self.error is not None:
            raise self.error
        if len(out) < n and self.succeeded >= 2:
            self._refresh()
            with self._lock:
                model = self.model
            if model is not None:
                points = self._batch(n - len(out), *model, exclude)
                self.asked += len(points)
                out += [(p, "model") for p in points]
        return out

    def _batch(self, n, forest, centres, exclude):
        rng = self.rng()
        genes = self._candidates(rng, centres)
        points = [self.space.decode(g) for g in genes]
        keys = [trial_key(p) for p in points]
        keep = [i for i, k in enumerate(keys) if k not in exclude]
        keep = list({keys[i]: i for i in reversed(keep)}.values())[::-1]  # first of each key
        if not keep:
            return []
        per_tree = self._per_tree(forest, np.asarray([self.space.encode(points[i])
                                                      for i in keep]))  # trees x candidates
        taken = np.zeros(len(keep), bool)
        out = []
        for kappa in rng.exponential(self.kappa, n) if self.kappa > 0 else np.zeros(n):
            half = per_tree[rng.random(self.trees) < 0.5] if self.trees > 3 else per_tree
            if len(half) < 2:
                half = per_tree
            j = _pick(half.mean(axis=0) - kappa * half.std(axis=0), taken)
            if j is None:
                break
            out.append(points[keep[j]])
        return out

    def tell_many(self, results) -> None:
        """A failed trial (None) is kept as NaN. With ``failures`` "ignore" (the default) a fit
        leaves it out; with "worst" it counts as the worst result so far (DeepHyper's "min").
        Measured on the 3DGAN-shaped problem (``benchmarks.gan3d_like``, whose best lr is
        2.5x below where it diverges), 256 virtual workers, 5 seeds: ignore 0.083, worst 0.168,
        random 0.289: the imputed cliff next to the optimum misleads the trees."""
        with self._lock:
            for point, loss in results:
                self.X.append(self.space.encode(point))
                self.y.append(float("nan") if loss is None else float(loss))
                self.succeeded += loss is not None


class EvolutionSearcher(Searcher):
    """Evolution with DEAP, asynchronous: no block waits for a generation.

    One objective: steady state; every ask breeds one child from the best ``population``
    evaluated points (tournament selection, uniform crossover, Gaussian mutation on numeric
    genes and random reset on categorical ones).
    Several objectives: NSGA-II (Deb et al. 2002) as DEAP's own example runs it; the parents
    are ``selNSGA2`` over every evaluated point (mu + lambda), the mating pool comes from
    ``selTournamentDCD``, children from simulated binary crossover and polynomial mutation
    (eta 20, per-gene rate 1/genes), handed out one by one as blocks ask.
    """

    max_objectives = 8

    def __init__(self, space, seed=0, n_objectives=1, population=12, tournament=3,
                 crossover=0.7, mutation_sigma=0.15, mutation_rate=0.3, eta=20.0):
        super().__init__(space, seed, n_objectives)
        if population < 2:
            raise ValueError(f"population must be at least 2, got {population}")
        self.population, self.tournament = population, tournament
        self.cxpb, self.sigma, self.indpb = crossover, mutation_sigma, mutation_rate
        self.eta = eta
        self.pool: List[tuple] = []      # (genes, losses tuple) of evaluated points
        self.children: List[list] = []   # NSGA-II offspring not handed out yet

    def _creator(self):
        from deap import base, creator

        name = f"MpilearnFitness{self.n_objectives}"
        if not hasattr(creator, name):
            creator.create(name, base.Fitness, weights=(-1.0,) * self.n_objectives)
            creator.create(f"MpilearnIndividual{self.n_objectives}", list,
                           fitness=getattr(creator, name))
        return getattr(creator, f"MpilearnIndividual{self.n_objectives}")

    def ask_many(self, n, pending=(), exclude=()):
        out = []
        exclude = KeyView(exclude)
        for _ in range(n):
            for _ in range(100):
                point, origin = self._one(len(pending) + len(out))
                if trial_key(point) not in exclude:
                    break
            else:
                break
            exclude.add(trial_key(point))
            out.append((point, origin))
        return out

    def _one(self, busy: int):
        rng = self.rng()
        self.asked += 1
        if len(self.pool) + busy < self.population and not self.children:
            return self.space.sample(rng), "initial"
        if len(self.pool) < 2:
            return self.space.sample(rng), "fallback"
        random.seed(int(rng.integers(2 ** 31)))  # DEAP's operators use the random module
        child = self._nsga2_child() if self.n_objectives > 1 else self._steady_child()
        return self.space.decode([min(max(g, 0.0), 1.0) for g in child]), "model"

    def _individuals(self, Individual):
        out = []
        for genes, losses in self.pool:
            ind = Individual(genes)
            ind.fitness.values = losses
            out.append(ind)
        return out

    def _steady_child(self):
        from deap import tools

        Individual = self._creator()
        best = sorted(self._individuals(Individual), key=lambda i: i.fitness.values[0])
        parents = best[:self.population]
        a, b = [Individual(list(p)) for p in tools.selTournament(parents, 2, self.tournament)]
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
        return a

    def _nsga2_child(self):
        from deap import tools

        if not self.children:
            Individual = self._creator()
            mu = max(4, self.population - self.population % 4)  # selTournamentDCD needs 4k
            evaluated = self._individuals(Individual)
            parents = tools.selNSGA2(evaluated, min(mu, len(evaluated)))  # sets crowding
            while len(parents) < mu:  # few evaluated yet: repeat the best
                parents.append(parents[len(parents) % max(1, len(evaluated))])
            pool = [Individual(list(p)) for p in tools.selTournamentDCD(parents, mu)]
            genes = len(self.space.params)
            for a, b in zip(pool[::2], pool[1::2]):
                if random.random() <= 0.9:
                    tools.cxSimulatedBinaryBounded(a, b, eta=self.eta, low=0.0, up=1.0)
                for c in (a, b):
                    tools.mutPolynomialBounded(c, eta=self.eta, low=0.0, up=1.0,
                                               indpb=1.0 / genes)
            self.children = [list(c) for c in pool]
        return self.children.pop(0)

    def tell_many(self, results):
        for point, losses in results:
            if losses is not None:
                losses = tuple(losses) if isinstance(losses, (tuple, list)) else (float(losses),)
                self.pool.append((self.space.encode(point), tuple(map(float, losses))))


SEARCHERS = {"random": RandomSearcher, "gp": GPSearcher, "evolution": EvolutionSearcher,
             "forest": ForestSearcher}


ACQ_FUNCS = ("EI", "PI", "LCB", "gp_hedge")


def searcher_options(cls) -> List[str]:
    """The options a searcher class takes (its constructors' named parameters)."""
    import inspect

    names = []
    for klass in cls.__mro__:
        if "__init__" in vars(klass):
            for p in inspect.signature(klass.__init__).parameters.values():
                if p.kind == p.POSITIONAL_OR_KEYWORD and p.name not in ("self", "space", "seed", "n_objectives"):
                    names.append(p.name)
    return sorted(set(names))


def choose(name: str, n_objectives: int = 1) -> str:
    """``search.searcher: auto``: evolution for several objectives (the only searcher of
    fronts), else gp at every size. Measured (docs/benchmarks/hpo.md): the GP's median regret is
    below the forest's at 1 024, 4 096 and 16 384 virtual workers on Hartmann-6 (0.0021 against
    0.0053 over 5 seeds at 4 096; one GP seed at 16 384) and at 256-4 096 on the 3DGAN-shaped
    problem, and at 4 096 in real time (one seed) it kept the blocks busier (99.22 % against
    96.64 %, regret 0.0009 against 0.0094)."""
    if name != "auto":
        return name
    return "evolution" if n_objectives > 1 else "gp"


def make_searcher(name: str, space: Space, seed: int = 0, n_objectives: int = 1,
                  **options) -> Searcher:
    """A searcher from its name and ``search.options``; unknown options and values the
    library would reject later are bad input (exit 2) before any trial runs."""
    from ..errors import UsageError
    from ..train.checks import did_you_mean

    if name not in SEARCHERS:
        raise UsageError(f"unknown searcher '{name}' (choose one of {', '.join(SEARCHERS)})")
    known = searcher_options(SEARCHERS[name])
    for option in options:
        if option not in known:
            raise UsageError(f"search.options.{option}: not an option of the {name} searcher"
                             f"{did_you_mean(option, known)} (it takes: "
                             f"{', '.join(known) or 'none'})")
    if n_objectives > SEARCHERS[name].max_objectives:
        raise UsageError(f"search.objective has {n_objectives} objectives; the {name} searcher "
                         "handles one (use searcher: evolution, NSGA-II, for several)")
    if name == "gp" and options.get("acq_func", "EI") not in ACQ_FUNCS:
        raise UsageError(f"search.options.acq_func is {options['acq_func']!r}; choose one of "
                         f"{', '.join(ACQ_FUNCS)}")
    try:
        return SEARCHERS[name](space, seed, n_objectives, **options)
    except (ValueError, TypeError) as err:  # a value the library rejects
        raise UsageError(f"search.options for the {name} searcher: {err}") from None
