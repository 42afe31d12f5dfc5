"""An RL rollout in pure JAX, PureJaxRL's shape: CartPole environments stepped in a
`vmap` inside a `lax.scan` of steps, inside a `lax.scan` of updates, the whole training
jitted; after each update a `jax.debug.callback` prints the returns of the episodes that
ended, as PureJaxRL's `ppo.py` does (`if config.get("DEBUG")`).

Sources: PureJaxRL, https://github.com/luchris429/purejaxrl (Apache-2.0): `make_train`'s
structure (`_update_step` scanning `_env_step` over `NUM_STEPS` on `NUM_ENVS` environments,
the `LogWrapper`'s episode returns, the DEBUG callback and its line); gymnax's CartPole-v1
dynamics and auto-reset, https://github.com/RobertTLange/gymnax (Apache-2.0), written
out here (gymnax's own package imports matplotlib and gymnasium). The learner is a
REINFORCE update of a linear softmax policy (PureJaxRL's PPO network is left out; the
loop and its callback are the point). Loop shape: `scan` of `scan` of `vmap`.
"""

import jax
import jax.numpy as jnp

ORDERED = False  # the callback is not ordered (PureJaxRL's is not)

NUM_ENVS, NUM_STEPS, NUM_UPDATES, LR = 4, 32, 6, 0.05
GRAVITY, MASSCART, MASSPOLE, LENGTH, FORCE, TAU = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
TOTAL_MASS, POLEMASS_LENGTH = MASSCART + MASSPOLE, MASSPOLE * LENGTH


def env_reset(key):
    return jax.random.uniform(key, (4,), minval=-0.05, maxval=0.05)


def env_step(key, state, action):
    x, x_dot, theta, theta_dot = state
    force = FORCE * (2 * action - 1)
    costheta, sintheta = jnp.cos(theta), jnp.sin(theta)
    temp = (force + POLEMASS_LENGTH * theta_dot**2 * sintheta) / TOTAL_MASS
    thetaacc = (GRAVITY * sintheta - costheta * temp) / (
        LENGTH * (4.0 / 3.0 - MASSPOLE * costheta**2 / TOTAL_MASS)
    )
    xacc = temp - POLEMASS_LENGTH * thetaacc * costheta / TOTAL_MASS
    state = jnp.stack([x + TAU * x_dot, x_dot + TAU * xacc,
                       theta + TAU * theta_dot, theta_dot + TAU * thetaacc])  # fmt: skip
    done = (jnp.abs(state[0]) > 2.4) | (jnp.abs(state[2]) > 12 * 2 * jnp.pi / 360)
    state = jnp.where(done, env_reset(key), state)  # gymnax's auto-reset
    return state, jnp.float32(1.0), done


def callback(info):
    return_values = info["returned_episode_returns"][info["returned_episode"]]
    timesteps = info["timestep"][info["returned_episode"]] * NUM_ENVS
    for t in range(len(timesteps)):
        print(f"global step={timesteps[t]}, episodic return={return_values[t]}")


def make_train():
    def train(rng):
        rng, reset_rng = jax.random.split(rng)
        states = jax.vmap(env_reset)(jax.random.split(reset_rng, NUM_ENVS))
        params = jnp.zeros((4, 2))
        log = (jnp.zeros(NUM_ENVS), jnp.zeros(NUM_ENVS, jnp.int32))

        def _update_step(runner_state, unused):
            params, states, log, rng, timestep = runner_state

            def _env_step(carry, unused):
                states, log, rng, timestep = carry
                rng, act_rng, step_rng = jax.random.split(rng, 3)
                logits = states @ params
                actions = jax.random.categorical(act_rng, logits)
                keys = jax.random.split(step_rng, NUM_ENVS)
                states_next, rewards, dones = jax.vmap(env_step)(keys, states, actions)
                returns, _ = log
                returns = returns + rewards
                info = {"returned_episode": dones, "returned_episode_returns": returns,
                        "timestep": jnp.full(NUM_ENVS, timestep)}  # fmt: skip
                log = (jnp.where(dones, 0.0, returns), log[1])
                transition = (states, actions, rewards, dones)
                return (states_next, log, rng, timestep + 1), (transition, info)

            (states, log, rng, timestep), (traj, info) = jax.lax.scan(
                _env_step, (states, log, rng, timestep), None, NUM_STEPS
            )
            obs, actions, rewards, _ = traj

            def loss(params):  # REINFORCE on the reward-to-go within the rollout
                togo = jnp.cumsum(rewards[::-1], axis=0)[::-1]
                logp = jax.nn.log_softmax(obs @ params)
                chosen = jnp.take_along_axis(logp, actions[..., None], axis=-1)[..., 0]
                return -jnp.mean(chosen * (togo - togo.mean()))

            params = params - LR * jax.grad(loss)(params)
            jax.debug.callback(callback, info)
            return (params, states, log, rng, timestep), info["returned_episode_returns"].mean()

        runner_state = (params, states, log, rng, jnp.int32(0))
        runner_state, metric = jax.lax.scan(_update_step, runner_state, None, NUM_UPDATES)
        return runner_state[0], metric

    return train


train = jax.jit(make_train())


def main():
    return train(jax.random.PRNGKey(42))


if __name__ == "__main__":
    print(main()[1])
