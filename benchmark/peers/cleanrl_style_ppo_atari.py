"""A CleanRL-style PPO Atari loop, kept only as a throughput baseline for benchmark/throughput.py.

Like CleanRL's `ppo_atari_multigpu.py`: gymnasium `SyncVectorEnv` with Python Atari wrappers,
float32 NCHW frames, foreach Adam, DDP; it logs only `charts/SPS`. Not a training script (no
checkpoints, no episode logging). Needs OpenCV for `AtariPreprocessing`:
`pip install opencv-python-headless`. Compare with:

    python -m benchmark.throughput --world-sizes 2 --compare benchmark/peers/cleanrl_style_ppo_atari.py
"""

import argparse
import os
import time

import ale_py
import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation, TransformReward
from torch.distributions.categorical import Categorical
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.tensorboard import SummaryWriter

gym.register_envs(ale_py)
p = argparse.ArgumentParser()
p.add_argument("--env-id", default="BreakoutNoFrameskip-v4")
p.add_argument("--seed", type=int, default=1)
p.add_argument("--runs-dir", default="runs")
p.add_argument("--run-name", default="cleanrl_style")
p.add_argument("--local-num-envs", type=int, default=4)
p.add_argument("--num-steps", type=int, default=128)
p.add_argument("--num-minibatches", type=int, default=4)
p.add_argument("--update-epochs", type=int, default=4)
p.add_argument("--total-timesteps", type=int, default=100000)
p.add_argument("--checkpoint-every", type=int, default=0)
args = p.parse_args()
rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
torch.set_num_threads(max(1, os.cpu_count() // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
if world > 1:
    dist.init_process_group("gloo")


def make_env(i):
    def thunk():
        env = gym.make(args.env_id)
        env = AtariPreprocessing(env, noop_max=30, frame_skip=4, terminal_on_life_loss=True)
        env = TransformReward(env, lambda r: float(np.sign(r)))
        return FrameStackObservation(env, 4)

    return thunk


def layer_init(layer, std=np.sqrt(2)):
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, 0.0)
    return layer


class Agent(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.network = nn.Sequential(
            layer_init(nn.Conv2d(4, 32, 8, stride=4)), nn.ReLU(),
            layer_init(nn.Conv2d(32, 64, 4, stride=2)), nn.ReLU(),
            layer_init(nn.Conv2d(64, 64, 3, stride=1)), nn.ReLU(), nn.Flatten(),
            layer_init(nn.Linear(3136, 512)), nn.ReLU(),
        )  # fmt: skip
        self.actor = layer_init(nn.Linear(512, n), std=0.01)
        self.critic = layer_init(nn.Linear(512, 1), std=1)

    def forward(self, x, action=None):
        h = self.network(x / 255.0)
        probs = Categorical(logits=self.actor(h))
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(h)


torch.manual_seed(args.seed)
envs = gym.vector.SyncVectorEnv([make_env(i) for i in range(args.local_num_envs)])
agent = Agent(envs.single_action_space.n)
model = DDP(agent) if world > 1 else agent
opt = optim.Adam(agent.parameters(), lr=2.5e-4, eps=1e-5)
writer = SummaryWriter(os.path.join(args.runs_dir, args.run_name)) if rank == 0 else None
N, S = args.local_num_envs, args.num_steps
obs = torch.zeros((S, N, 4, 84, 84))
actions, logprobs, rewards, dones, values = (torch.zeros((S, N)) for _ in range(5))
next_obs = torch.Tensor(envs.reset(seed=args.seed + rank * N)[0])
next_done = torch.zeros(N)
global_step, start = 0, time.time()
for _iteration in range(args.total_timesteps // (S * N * world)):
    for step in range(S):
        global_step += N * world
        obs[step], dones[step] = next_obs, next_done
        with torch.no_grad():
            action, logprob, _, value = agent(next_obs)
        values[step], actions[step], logprobs[step] = value.flatten(), action, logprob
        o, r, te, tr, _ = envs.step(action.numpy())
        rewards[step] = torch.tensor(r)
        next_obs, next_done = torch.Tensor(o), torch.Tensor(np.logical_or(te, tr))
    with torch.no_grad():
        next_value = agent(next_obs)[3].reshape(1, -1)
        adv = torch.zeros_like(rewards)
        last = 0
        for t in reversed(range(S)):
            nnt = 1.0 - (next_done if t == S - 1 else dones[t + 1])
            nv = next_value if t == S - 1 else values[t + 1]
            delta = rewards[t] + 0.99 * nv * nnt - values[t]
            adv[t] = last = delta + 0.99 * 0.95 * nnt * last
        ret = adv + values
    b_obs, b_lp, b_a = obs.reshape(-1, 4, 84, 84), logprobs.reshape(-1), actions.reshape(-1).long()
    b_adv, b_ret, b_v = adv.reshape(-1), ret.reshape(-1), values.reshape(-1)
    mb = S * N // args.num_minibatches
    for _epoch in range(args.update_epochs):
        inds = np.random.permutation(S * N)
        for s in range(0, S * N, mb):
            i = inds[s : s + mb]
            _, nlp, ent, nv = model(b_obs[i], b_a[i])
            ratio = (nlp - b_lp[i]).exp()
            a = (b_adv[i] - b_adv[i].mean()) / (b_adv[i].std() + 1e-8)
            pg = torch.max(-a * ratio, -a * ratio.clamp(0.9, 1.1)).mean()
            v = 0.5 * ((nv.view(-1) - b_ret[i]) ** 2).mean()
            loss = pg - 0.01 * ent.mean() + 0.5 * v
            opt.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(agent.parameters(), 0.5)
            opt.step()
    if writer:
        writer.add_scalar("charts/SPS", int(global_step / (time.time() - start)), global_step)
        writer.flush()
if writer:
    writer.close()
if world > 1:
    dist.destroy_process_group()
