"""PPO the cleanrl way: rollouts, GAE, several minibatch epochs per rollout, lr annealed by hand.

Imitates vwxyzjn/cleanrl ``cleanrl/ppo.py``: ``Agent`` (actor and critic MLPs with Tanh,
``layer_init`` orthogonal with std sqrt(2), 0.01 for the policy head, 1 for the value head),
``Adam(lr=2.5e-4, eps=1e-5)``, ``optimizer.param_groups[0]["lr"] = frac * learning_rate`` at each
iteration, GAE, normalised advantages, the clipped surrogate, a clipped value loss, an entropy
bonus, ``clip_grad_norm_(max_grad_norm=0.5)``, and ``update_epochs`` passes of
``num_minibatches`` minibatches over each rollout. The losses it logs (policy loss, value
loss, entropy, and their sum) are not expected to fall: every rollout brings new targets.
The environment is a vectorised toy in torch (reward 1 for the action the observation points
at; episodes of 8 steps).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn
from torch.distributions import Categorical

import stepdump
from corpus import MODES

NUM_ENVS, NUM_STEPS, NUM_MINIBATCHES, UPDATE_EPOCHS, NUM_ITERATIONS = 4, 16, 4, 4, 2
OBS, ACTIONS = 4, 2
LEARNING_RATE, GAMMA, GAE_LAMBDA, CLIP_COEF, ENT_COEF, VF_COEF = 2.5e-4, 0.99, 0.95, 0.2, 0.01, 0.5
FAULTS: dict[str, int] = {}


def layer_init(layer: nn.Linear, std: float = math.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.critic = nn.Sequential(layer_init(nn.Linear(OBS, 16)), nn.Tanh(), layer_init(nn.Linear(16, 16)), nn.Tanh(),
                                    layer_init(nn.Linear(16, 1), std=1.0))
        self.actor = nn.Sequential(layer_init(nn.Linear(OBS, 16)), nn.Tanh(), layer_init(nn.Linear(16, 16)), nn.Tanh(),
                                   layer_init(nn.Linear(16, ACTIONS), std=0.01))

    def get_value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(x)

    def get_action_and_value(self, x: torch.Tensor, action: torch.Tensor | None = None,
                             gen: torch.Generator | None = None) -> tuple[torch.Tensor, ...]:
        probs = Categorical(logits=self.actor(x))
        if action is None:
            action = torch.multinomial(probs.probs, 1, generator=gen).squeeze(1)
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)


class Envs:
    """NUM_ENVS copies of a toy task: the observation's sign says which action pays 1."""

    def __init__(self, gen: torch.Generator) -> None:
        self.gen, self.t = gen, torch.zeros(NUM_ENVS, dtype=torch.long)
        self.obs = torch.randn(NUM_ENVS, OBS, generator=gen)

    def step(self, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        reward = (action == (self.obs[:, 0] > 0).long()).float()
        self.t += 1
        done = (self.t % 8 == 0).float()
        self.obs = torch.randn(NUM_ENVS, OBS, generator=self.gen)
        return self.obs, reward, done


def record(path: Path, mode: str, fault: str | None = None) -> dict[str, Path]:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    agent = Agent()
    optimizer = torch.optim.Adam(agent.parameters(), lr=LEARNING_RATE, eps=1e-5)
    envs = Envs(gen)
    batch_size = NUM_ENVS * NUM_STEPS
    minibatch_size = batch_size // NUM_MINIBATCHES
    obs = torch.zeros(NUM_STEPS, NUM_ENVS, OBS)
    actions, logprobs, rewards, dones, values = (torch.zeros(NUM_STEPS, NUM_ENVS) for _ in range(5))
    next_obs, next_done = envs.obs, torch.zeros(NUM_ENVS)
    with stepdump.Recorder(path, agent, optimizer, **MODES[mode]) as rec:
        for iteration in range(1, NUM_ITERATIONS + 1):
            frac = 1.0 - (iteration - 1.0) / NUM_ITERATIONS
            optimizer.param_groups[0]["lr"] = frac * LEARNING_RATE
            for step in range(NUM_STEPS):
                obs[step], dones[step] = next_obs, next_done
                with torch.no_grad():
                    action, logprob, _, value = agent.get_action_and_value(next_obs, gen=gen)
                    values[step] = value.flatten()
                actions[step], logprobs[step] = action, logprob
                next_obs, rewards[step], next_done = envs.step(action)
            with torch.no_grad():
                next_value = agent.get_value(next_obs).reshape(1, -1)
                advantages = torch.zeros_like(rewards)
                lastgaelam = torch.zeros(NUM_ENVS)
                for t in reversed(range(NUM_STEPS)):
                    nextnonterminal = 1.0 - (next_done if t == NUM_STEPS - 1 else dones[t + 1])
                    nextvalues = next_value if t == NUM_STEPS - 1 else values[t + 1]
                    delta = rewards[t] + GAMMA * nextvalues * nextnonterminal - values[t]
                    advantages[t] = lastgaelam = delta + GAMMA * GAE_LAMBDA * nextnonterminal * lastgaelam
                returns = advantages + values
            b_obs, b_logprobs, b_actions = obs.reshape(-1, OBS), logprobs.reshape(-1), actions.reshape(-1)
            b_advantages, b_returns, b_values = advantages.reshape(-1), returns.reshape(-1), values.reshape(-1)
            for _ in range(UPDATE_EPOCHS):
                b_inds = torch.randperm(batch_size, generator=gen)
                for start in range(0, batch_size, minibatch_size):
                    mb = b_inds[start:start + minibatch_size]
                    _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb], b_actions.long()[mb])
                    logratio = newlogprob - b_logprobs[mb]
                    ratio = logratio.exp()
                    with torch.no_grad():
                        approx_kl = ((ratio - 1) - logratio).mean()
                        clipfrac = ((ratio - 1.0).abs() > CLIP_COEF).float().mean()
                    mb_adv = (b_advantages[mb] - b_advantages[mb].mean()) / (b_advantages[mb].std() + 1e-8)
                    pg_loss = torch.max(-mb_adv * ratio, -mb_adv * torch.clamp(ratio, 1 - CLIP_COEF, 1 + CLIP_COEF)).mean()
                    newvalue = newvalue.view(-1)
                    v_clipped = b_values[mb] + torch.clamp(newvalue - b_values[mb], -CLIP_COEF, CLIP_COEF)
                    v_loss = 0.5 * torch.max((newvalue - b_returns[mb]) ** 2, (v_clipped - b_returns[mb]) ** 2).mean()
                    entropy_loss = entropy.mean()
                    loss = pg_loss - ENT_COEF * entropy_loss + v_loss * VF_COEF
                    optimizer.zero_grad()
                    loss.backward()
                    nn.utils.clip_grad_norm_(agent.parameters(), 0.5)
                    optimizer.step()
                    rec.log(loss=loss.item(), policy_loss=pg_loss.item(), value_loss=v_loss.item(),
                            entropy=entropy_loss.item(), approx_kl=approx_kl.item(), clipfrac=clipfrac.item())
    return {"": path}
