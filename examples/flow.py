"""A Glow-style normalizing flow on small images, with no hand-written log-determinant.

Run with `python examples/flow.py` (about a minute on a 2-core CPU; `--steps N` trains N
steps instead of 1000). The model is the generative direction, a plain JAX function
of ONE latent image z of shape (8, 8, 2) and the parameters, returning one image x:

    x = glow(z, params),   z ~ N(0, I).

Read from the data side, each of its LEVELS steps is Glow's (Kingma & Dhariwal, 2018):

    actnorm          x * exp(logs) + b                    a scale and bias per channel
    1x1 convolution  x @ W,  W = P @ L @ U                P a fixed permutation, L unit lower
                                                          triangular, U upper triangular with
                                                          diagonal sign * exp(log_s)
    affine coupling  jnp.where(mask, x, x * exp(s) + t)   s = tanh(.), t from an MLP of x * mask

and nowhere in the code is a log-determinant. `jr.Bijector(glow, event_ndims=3)` gets it from
the inversion: `inverse_and_log_det(x)` runs glow backwards, image to latent, and sums the
log-determinants of the steps it inverts on the way (the actnorm's scales, exp(s) on the
coupling's unmasked pixels, det W once per pixel), so changing the model needs no new log-det
formula; the methods take a batch of images and vmap over it. Training maximises the likelihood
of generated images (oriented bars, quantised to 16 levels and dequantised with uniform noise):

    log p(x) = log N(z; 0, I) + log|det dz/dx|,   (z, log|det dz/dx|) = inverse_and_log_det(x),

reported in bits per pixel and channel of the 16-level images; sampling is `forward(z)`. The
checks: the log-det equals `slogdet(jacfwd(glow))` (float64), `jr.logdet_strategy` says
"sweep" (no dense Jacobian anywhere), the inverse undoes the forward, and what the log-det costs
next to a plain forward pass.
"""

import argparse
import os
import time

# The dense reference check (jacfwd + slogdet) and the 1x1 convolutions' inverses call LAPACK
# from scipy's OpenBLAS on CPU, whose thread pool gains nothing on matrices this small and, on a
# busy 2-core machine, costs milliseconds a call. One thread unless the caller says so.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import jax  # noqa: E402

# The log-det check compares with a dense slogdet to 1e-9: float64 rounding is needed.
jax.config.update("jax_enable_x64", True)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import scipy.linalg  # noqa: E402  (a dependency of jax)

import jaxrev as jr  # noqa: E402

H, W, C = 8, 8, 2  # image shape: D = 128 numbers per image
D = H * W * C
LEVELS, HIDDEN, BATCH, STEPS, K = 6, 64, 128, 1000, 16  # K: quantisation levels of the data

_i, _j, _c = np.meshgrid(np.arange(H), np.arange(W), np.arange(C), indexing="ij")
# level k keeps one colour of a 3-D checkerboard over (row, column, channel), then the other
MASKS = [(_i + _j + _c) % 2 == k % 2 for k in range(LEVELS)]
FIXED = ("perm", "sign")  # the parts of W that are not trained


def glow(z, params):
    """Latent (H, W, C) -> image (H, W, C): per level a coupling, a 1x1 conv and an actnorm."""
    x = z
    for mask, p in zip(MASKS, params):
        # affine coupling: the masked pixels pass, and give the others a scale and a shift
        h = jnp.tanh((x * mask).reshape(-1) @ p["w1"] + p["b1"])
        st = (h @ p["w2"]).reshape(H, W, C, 2)
        s, t = jnp.tanh(st[..., 0]), st[..., 1]  # bounded log-scale
        x = jnp.where(mask, x, x * jnp.exp(s) + t)
        # invertible 1x1 convolution: the same C x C matrix on every pixel's channels
        lower = jnp.tril(p["lu"], -1) + jnp.eye(C)
        upper = jnp.triu(p["lu"], 1) + jnp.diag(p["sign"] * jnp.exp(p["log_s"]))
        x = x @ (p["perm"] @ lower @ upper)
        # actnorm
        x = x * jnp.exp(p["logs"]) + p["b"]
    return x


flow = jr.Bijector(glow, event_ndims=3)  # forward: latent -> image; inverse: image -> latent


def nll(params, x):
    """Mean negative log-likelihood of a batch of images, in nats per image."""
    z, logdet = flow.inverse_and_log_det(x, params)
    log_base = -0.5 * jnp.sum(z**2, axis=(1, 2, 3)) - 0.5 * D * jnp.log(2 * jnp.pi)
    return -jnp.mean(log_base + logdet)


def bits_per_dim(nats):
    # the density of the dequantised images gives a bound on the 16-level images' code length
    return nats / (D * np.log(2)) + np.log2(K)


def bars(rng, n):
    """n images of a bar through the middle at a random angle: channel 0 the bar, channel 1 the
    bar weighted by how horizontal it is; quantised to K levels and dequantised."""
    theta = rng.uniform(0, np.pi, (n, 1, 1))
    cy, cx = 3.5 + rng.uniform(-1.5, 1.5, (2, n, 1, 1))
    i, j = np.arange(H)[:, None], np.arange(W)[None, :]
    dist = np.abs((j - cx) * np.sin(theta) - (i - cy) * np.cos(theta))
    bar = np.exp(-0.5 * (dist / 0.7) ** 2)
    img = np.stack([bar, bar * np.abs(np.cos(theta))], axis=-1)
    img = np.clip(img + 0.02 * rng.normal(size=img.shape), 0, 1)
    levels = np.minimum(np.floor(img * K), K - 1)
    return (levels + rng.uniform(size=img.shape)) / K


def init(rng, data):
    def level():
        # W starts as a random rotation, stored as Glow stores it: its pivoted LU factors
        perm, lower, upper = scipy.linalg.lu(np.linalg.qr(rng.normal(size=(C, C)))[0])
        return {
            "w1": rng.normal(size=(D, HIDDEN)) / np.sqrt(D / 2),
            "b1": np.zeros(HIDDEN),
            "w2": 0.01 * rng.normal(size=(HIDDEN, 2 * D)),
            "perm": perm,
            "sign": np.sign(np.diag(upper)),
            "lu": np.tril(lower, -1) + np.triu(upper, 1),
            "log_s": np.log(np.abs(np.diag(upper))),
            "logs": np.zeros(C),
            "b": np.zeros(C),
        }

    params = [level() for _ in range(LEVELS)]
    # Glow's data-dependent init, for the actnorm next to the data only: match each channel's
    # mean and spread.
    params[-1]["logs"] = np.log(data.std(axis=(0, 1, 2)))
    params[-1]["b"] = data.mean(axis=(0, 1, 2))
    return params


def ascii_rows(images):
    """One text row per image row, the images side by side; channel sum as brightness."""
    ramp = " .:-=+*#%@"
    rows = []
    for r in range(H):
        cells = []
        for img in images:
            v = np.clip(img[r].sum(-1) / 1.5, 0, 0.999)
            cells.append("".join(2 * ramp[int(a * len(ramp))] for a in v))
        rows.append("  " + "  |".join(cells))
    return rows


def main(steps: int = STEPS):
    t0 = time.perf_counter()
    rng = np.random.default_rng(0)
    test = bars(rng, 2048)
    params = init(rng, test)
    trainable = [{k: v for k, v in p.items() if k not in FIXED} for p in params]
    fixed = [{k: p[k] for k in FIXED} for p in params]

    def full(trainable):
        return [{**a, **b} for a, b in zip(trainable, fixed)]

    # 1. Maximum likelihood with adam, a fresh batch of images every step.
    opt = optax.adam(2e-3)

    @jax.jit
    def train_step(trainable, state, batch):
        value, grads = jax.value_and_grad(lambda p: nll(full(p), batch))(trainable)
        updates, state = opt.update(grads, state, trainable)
        return optax.apply_updates(trainable, updates), state, value

    held_out = jax.jit(nll)
    start = float(held_out(params, test))
    print(f"{LEVELS} levels of actnorm, 1x1 conv, coupling on {H}x{W}x{C} images")
    print(f"initial held-out NLL: {start / D:.4f} nats/dim = {bits_per_dim(start):.3f} bits/dim")
    state = opt.init(trainable)
    for step in range(steps + 1):
        trainable, state, value = train_step(trainable, state, bars(rng, BATCH))
        if step % 250 == 0:
            print(f"step {step:4d}  NLL {bits_per_dim(float(value)):.3f} bits/dim")
    params = full(trainable)
    end = float(held_out(params, test))
    print(f"final held-out NLL: {end / D:.4f} nats/dim = {bits_per_dim(end):.3f} bits/dim")

    # 2. Sampling: the generative direction is the function itself.
    z = jnp.asarray(rng.normal(size=(4, H, W, C)))
    samples = jax.jit(flow.forward)(z, params)
    print("data (left) and samples from the flow (right):")
    for row in ascii_rows(list(test[:4]) + list(np.asarray(samples))):
        print(row)

    # 3. Checks.
    # (a) jaxrev inverts every step, so no dense Jacobian is formed anywhere
    print(f"logdet strategy: {jr.logdet_strategy(glow, z[0], params)}")
    # (b) both log-dets of the samples against slogdet of the dense Jacobian of glow
    zs, ild = jax.jit(flow.inverse_and_log_det)(samples, params)
    jac = jax.jit(jax.vmap(jax.jacfwd(glow), (0, None)))(zs, params)
    _, ref = jnp.linalg.slogdet(jac.reshape(-1, D, D))
    _, fld = jax.jit(flow.forward_and_log_det)(zs, params)
    err = float(jnp.max(jnp.maximum(jnp.abs(ild + ref), jnp.abs(fld - ref))))
    print(
        f"log-det vs dense slogdet, max abs error: {err:.1e} "
        f"(log|det dx/dz| of the samples: {', '.join(f'{v:.2f}' for v in ref.tolist())})"
    )
    # (c) the inverse undoes the forward
    zs = jnp.asarray(rng.normal(size=(256, H, W, C)))
    back = jax.jit(flow.inverse)(jax.jit(flow.forward)(zs, params), params)
    print(f"round-trip max error: {float(jnp.max(jnp.abs(back - zs))):.1e}")
    # (d) what the log-det costs: informative only
    timings, batch = {}, jnp.asarray(test[:BATCH])
    for name, f in (
        ("forward", flow.forward),
        ("inverse", flow.inverse),
        ("inverse_and_log_det", flow.inverse_and_log_det),
    ):
        f = jax.jit(f)
        jax.block_until_ready(f(batch, params))
        t = time.perf_counter()
        for _ in range(20):
            out = f(batch, params)
        jax.block_until_ready(out)
        timings[name] = (time.perf_counter() - t) / 20
    print(
        f"per batch of {BATCH}: "
        + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in timings.items())
        + f" ({timings['inverse_and_log_det'] / timings['forward']:.1f}x forward)"
    )
    print(f"flow finished in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=STEPS, help="training steps")
    main(ap.parse_args().steps)
