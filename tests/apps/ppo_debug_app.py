"""A PureJaxRL-like PPO training script: the shape of a real `jax.debug.callback` user.

`make_train(config)` returns a `train(rng)` function, which is jitted (and vmapped over
seeds, as PureJaxRL's `jax.vmap(make_train(config))(rngs)` is) and runs a `lax.scan` over
updates; each update runs an inner `lax.scan` of `NUM_STEPS` steps over a `vmap` of
`NUM_ENVS` CartPole environments (pure JAX, gymnax's dynamics, with a LogWrapper-like
episode tracker), then PPO epochs over minibatches (hand-written Adam: no optax here),
then calls `jax.debug.callback(callback, metric)` with a metrics dict, whose callback
prints the returns of the episodes that ended, exactly as PureJaxRL's `ppo.py` does.
A last line is printed by the main thread after training.

Run with plain `python` (JAX's `jax.debug`) for the reference output, or with
`python -m tapd.debug tests/apps/ppo_debug_app.py` (tapd's). Needs only jax and numpy;
a few seconds on CPU (JAX_PLATFORMS=cpu).
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

CONFIG: dict[str, Any] = {
    "LR": 2.5e-3,
    "NUM_ENVS": 4,
    "NUM_STEPS": 64,
    "TOTAL_TIMESTEPS": 4 * 64 * 12,
    "UPDATE_EPOCHS": 2,
    "NUM_MINIBATCHES": 2,
    "GAMMA": 0.99,
    "GAE_LAMBDA": 0.95,
    "CLIP_EPS": 0.2,
    "ENT_COEF": 0.01,
    "VF_COEF": 0.5,
    "HIDDEN": 32,
    "NUM_SEEDS": 2,
}


# ---- environment: CartPole (gymnax's dynamics), auto-reset, episode statistics -------------


class EnvState(NamedTuple):
    x: jax.Array
    x_dot: jax.Array
    theta: jax.Array
    theta_dot: jax.Array
    time: jax.Array


class LogState(NamedTuple):
    env_state: EnvState
    episode_returns: jax.Array
    episode_lengths: jax.Array
    returned_episode_returns: jax.Array
    returned_episode_lengths: jax.Array
    timestep: jax.Array


MAX_STEPS = 200


def env_reset(key: jax.Array) -> tuple[jax.Array, EnvState]:
    init = jax.random.uniform(key, minval=-0.05, maxval=0.05, shape=(4,))
    state = EnvState(init[0], init[1], init[2], init[3], jnp.int32(0))
    return _obs(state), state


def _obs(state: EnvState) -> jax.Array:
    return jnp.array([state.x, state.x_dot, state.theta, state.theta_dot])


def env_step(key: jax.Array, state: EnvState, action: jax.Array) -> tuple[Any, ...]:
    gravity, masscart, masspole, length, force_mag, tau = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
    total_mass = masscart + masspole
    polemass_length = masspole * length
    force = force_mag * action - force_mag * (1 - action)
    costheta, sintheta = jnp.cos(state.theta), jnp.sin(state.theta)
    temp = (force + polemass_length * state.theta_dot**2 * sintheta) / total_mass
    thetaacc = (gravity * sintheta - costheta * temp) / (
        length * (4.0 / 3.0 - masspole * costheta**2 / total_mass)
    )
    xacc = temp - polemass_length * thetaacc * costheta / total_mass
    x = state.x + tau * state.x_dot
    x_dot = state.x_dot + tau * xacc
    theta = state.theta + tau * state.theta_dot
    theta_dot = state.theta_dot + tau * thetaacc
    new = EnvState(x, x_dot, theta, theta_dot, state.time + 1)
    done = (
        (x < -2.4) | (x > 2.4) | (theta < -12 * 2 * jnp.pi / 360) | (theta > 12 * 2 * jnp.pi / 360)
    ) | (new.time >= MAX_STEPS)
    reward = jnp.float32(1.0)
    _, reset = env_reset(key)
    new = jax.tree_util.tree_map(lambda r, n: jnp.where(done, r, n), reset, new)
    return _obs(new), new, reward, done


def log_reset(key: jax.Array) -> tuple[jax.Array, LogState]:
    obs, env_state = env_reset(key)
    zero_f, zero_i = jnp.float32(0.0), jnp.int32(0)
    return obs, LogState(env_state, zero_f, zero_i, zero_f, zero_i, zero_i)


def log_step(key: jax.Array, state: LogState, action: jax.Array) -> tuple[Any, ...]:
    obs, env_state, reward, done = env_step(key, state.env_state, action)
    new_return = state.episode_returns + reward
    new_length = state.episode_lengths + 1
    state = LogState(
        env_state=env_state,
        episode_returns=new_return * (1 - done),
        episode_lengths=new_length * (1 - done),
        returned_episode_returns=state.returned_episode_returns * (1 - done) + new_return * done,
        returned_episode_lengths=state.returned_episode_lengths * (1 - done) + new_length * done,
        timestep=state.timestep + 1,
    )
    info = {
        "returned_episode_returns": state.returned_episode_returns,
        "returned_episode_lengths": state.returned_episode_lengths,
        "timestep": state.timestep,
        "returned_episode": done,
    }
    return obs, state, reward, done, info


# ---- actor-critic, hand-written ----------------------------------------------------------


def init_params(key: jax.Array, hidden: int) -> dict[str, Any]:
    k = jax.random.split(key, 4)

    def dense(key: jax.Array, n_in: int, n_out: int, scale: float) -> dict[str, jax.Array]:
        w = jax.random.normal(key, (n_in, n_out)) * scale / jnp.sqrt(n_in)
        return {"w": w, "b": jnp.zeros((n_out,))}

    return {
        "a1": dense(k[0], 4, hidden, 1.4),
        "a2": dense(k[1], hidden, 2, 0.01),
        "c1": dense(k[2], 4, hidden, 1.4),
        "c2": dense(k[3], hidden, 1, 1.0),
    }


def network(params: dict[str, Any], obs: jax.Array) -> tuple[jax.Array, jax.Array]:
    a = jnp.tanh(obs @ params["a1"]["w"] + params["a1"]["b"])
    logits = a @ params["a2"]["w"] + params["a2"]["b"]
    c = jnp.tanh(obs @ params["c1"]["w"] + params["c1"]["b"])
    value = (c @ params["c2"]["w"] + params["c2"]["b"])[..., 0]
    return logits, value


class Transition(NamedTuple):
    done: jax.Array
    action: jax.Array
    value: jax.Array
    reward: jax.Array
    log_prob: jax.Array
    obs: jax.Array
    info: Any


def _log_prob(logits: jax.Array, action: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits)
    return jnp.take_along_axis(logp, action[..., None], axis=-1)[..., 0]


def _entropy(logits: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def adam(params: Any, grads: Any, opt: Any, lr: float) -> tuple[Any, Any]:
    m, v, t = opt
    t = t + 1
    m = jax.tree_util.tree_map(lambda m, g: 0.9 * m + 0.1 * g, m, grads)
    v = jax.tree_util.tree_map(lambda v, g: 0.999 * v + 0.001 * g * g, v, grads)
    mhat = jax.tree_util.tree_map(lambda m: m / (1 - 0.9**t), m)
    vhat = jax.tree_util.tree_map(lambda v: v / (1 - 0.999**t), v)
    params = jax.tree_util.tree_map(
        lambda p, mh, vh: p - lr * mh / (jnp.sqrt(vh) + 1e-5), params, mhat, vhat
    )
    return params, (m, v, t)


# ---- PureJaxRL's make_train --------------------------------------------------------------


def make_train(config: dict[str, Any]) -> Any:
    config["NUM_UPDATES"] = config["TOTAL_TIMESTEPS"] // config["NUM_STEPS"] // config["NUM_ENVS"]
    config["MINIBATCH_SIZE"] = config["NUM_ENVS"] * config["NUM_STEPS"] // config["NUM_MINIBATCHES"]

    def train(rng: jax.Array) -> dict[str, Any]:
        rng, _rng = jax.random.split(rng)
        params = init_params(_rng, config["HIDDEN"])
        zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
        opt = (zeros, zeros, jnp.int32(0))

        rng, _rng = jax.random.split(rng)
        reset_rng = jax.random.split(_rng, config["NUM_ENVS"])
        obsv, env_state = jax.vmap(log_reset)(reset_rng)

        def _update_step(runner_state: Any, unused: Any) -> tuple[Any, Any]:
            def _env_step(runner_state: Any, unused: Any) -> tuple[Any, Transition]:
                params, opt, env_state, last_obs, rng = runner_state
                rng, _rng = jax.random.split(rng)
                logits, value = network(params, last_obs)
                action = jax.random.categorical(_rng, logits)
                log_prob = _log_prob(logits, action)
                rng, _rng = jax.random.split(rng)
                rng_step = jax.random.split(_rng, config["NUM_ENVS"])
                obsv, env_state, reward, done, info = jax.vmap(log_step)(
                    rng_step, env_state, action
                )
                transition = Transition(done, action, value, reward, log_prob, last_obs, info)
                return (params, opt, env_state, obsv, rng), transition

            runner_state, traj_batch = jax.lax.scan(
                _env_step, runner_state, None, config["NUM_STEPS"]
            )
            params, opt, env_state, last_obs, rng = runner_state
            _, last_val = network(params, last_obs)

            def _get_advantages(gae_and_next_value: Any, transition: Transition) -> Any:
                gae, next_value = gae_and_next_value
                done, value, reward = transition.done, transition.value, transition.reward
                delta = reward + config["GAMMA"] * next_value * (1 - done) - value
                gae = delta + config["GAMMA"] * config["GAE_LAMBDA"] * (1 - done) * gae
                return (gae, value), gae

            _, advantages = jax.lax.scan(
                _get_advantages,
                (jnp.zeros_like(last_val), last_val),
                traj_batch,
                reverse=True,
                unroll=16,
            )
            targets = advantages + traj_batch.value

            def _update_epoch(update_state: Any, unused: Any) -> tuple[Any, Any]:
                def _update_minibatch(train_state: Any, batch_info: Any) -> tuple[Any, Any]:
                    params, opt = train_state
                    traj, gae, targets = batch_info

                    def _loss_fn(params: Any) -> tuple[jax.Array, Any]:
                        logits, value = network(params, traj.obs)
                        log_prob = _log_prob(logits, traj.action)
                        value_pred_clipped = traj.value + (value - traj.value).clip(
                            -config["CLIP_EPS"], config["CLIP_EPS"]
                        )
                        value_losses = jnp.square(value - targets)
                        value_losses_clipped = jnp.square(value_pred_clipped - targets)
                        value_loss = 0.5 * jnp.maximum(value_losses, value_losses_clipped).mean()
                        ratio = jnp.exp(log_prob - traj.log_prob)
                        norm = (gae - gae.mean()) / (gae.std() + 1e-8)
                        loss1 = ratio * norm
                        loss2 = (
                            jnp.clip(ratio, 1.0 - config["CLIP_EPS"], 1.0 + config["CLIP_EPS"])
                            * norm
                        )
                        loss_actor = -jnp.minimum(loss1, loss2).mean()
                        entropy = _entropy(logits).mean()
                        total = (
                            loss_actor
                            + config["VF_COEF"] * value_loss
                            - config["ENT_COEF"] * entropy
                        )
                        return total, (value_loss, loss_actor, entropy)

                    (total, aux), grads = jax.value_and_grad(_loss_fn, has_aux=True)(params)
                    params, opt = adam(params, grads, opt, config["LR"])
                    return (params, opt), (total, aux)

                params, opt, traj_batch, advantages, targets, rng = update_state
                rng, _rng = jax.random.split(rng)
                batch_size = config["MINIBATCH_SIZE"] * config["NUM_MINIBATCHES"]
                permutation = jax.random.permutation(_rng, batch_size)
                batch = (traj_batch, advantages, targets)
                batch = jax.tree_util.tree_map(
                    lambda x: x.reshape((batch_size, *x.shape[2:])), batch
                )
                shuffled = jax.tree_util.tree_map(lambda x: jnp.take(x, permutation, axis=0), batch)
                minibatches = jax.tree_util.tree_map(
                    lambda x: jnp.reshape(x, [config["NUM_MINIBATCHES"], -1, *list(x.shape[1:])]),
                    shuffled,
                )
                (params, opt), total_loss = jax.lax.scan(
                    _update_minibatch, (params, opt), minibatches
                )
                return (params, opt, traj_batch, advantages, targets, rng), total_loss

            update_state = (params, opt, traj_batch, advantages, targets, rng)
            update_state, _loss_info = jax.lax.scan(
                _update_epoch, update_state, None, config["UPDATE_EPOCHS"]
            )
            params, opt = update_state[0], update_state[1]
            rng = update_state[-1]
            metric = traj_batch.info

            def callback(info: dict[str, Any]) -> None:
                return_values = info["returned_episode_returns"][info["returned_episode"]]
                timesteps = info["timestep"][info["returned_episode"]] * config["NUM_ENVS"]
                for t in range(len(timesteps)):
                    print(f"global step={timesteps[t]}, episodic return={return_values[t]}")

            jax.debug.callback(callback, metric)

            runner_state = (params, opt, env_state, last_obs, rng)
            return runner_state, metric

        rng, _rng = jax.random.split(rng)
        runner_state = (params, opt, env_state, obsv, _rng)
        runner_state, metric = jax.lax.scan(_update_step, runner_state, None, config["NUM_UPDATES"])
        return {"runner_state": runner_state, "metrics": metric}

    return train


def main(argv: list[str]) -> None:
    """`--no-wait`: end as PureJaxRL's ppo.py does, right after `out = train_jit(rng)`
    (the computation still running: JAX's async dispatch), printing a last line that
    does not wait for it. `--updates N`: more updates (default 12)."""
    if "--updates" in argv:
        updates = int(argv[argv.index("--updates") + 1])
        CONFIG["TOTAL_TIMESTEPS"] = CONFIG["NUM_ENVS"] * CONFIG["NUM_STEPS"] * updates
    rng = jax.random.PRNGKey(30)
    rngs = jax.random.split(rng, CONFIG["NUM_SEEDS"])
    train_vjit = jax.jit(jax.vmap(make_train(CONFIG)))
    if "--no-wait" in argv:
        out = train_vjit(rngs)
        print(f"final: dispatched {CONFIG['NUM_UPDATES']} updates of {CONFIG['NUM_SEEDS']} seeds")
        return
    out = jax.block_until_ready(train_vjit(rngs))
    returns = np.asarray(out["metrics"]["returned_episode_returns"])
    print(f"final mean return={returns[:, -1].mean():.3f} over {returns.shape[0]} seeds")
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1:])
