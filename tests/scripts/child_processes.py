"""Processes started by the training, as Hogwild, sweeps and DataLoaders do it.

    python child_processes.py train START LR     the parent trains, then a child process (START: spawn or fork)
                                                 trains another model with LR; prints the child's result
    python child_processes.py loader             a DataLoader with two worker processes feeds the training
    python child_processes.py pool               a multiprocessing pool (fork) trains two models
    python child_processes.py forked             an os.fork() child trains a step and leaves through the script's end
    python child_processes.py terminated         a forked child blocked on a lock is terminated (SIGTERM); prints its exit code
    python child_processes.py prepared           data prepared in forked children and a pool by a `datasets` stand-in
                                                 (prep/datasets), then trained on
"""

import os
import sys
import time

import torch
import torch.multiprocessing as mp


def train(lr: float, steps: int = 3) -> float:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(m.parameters(), lr=lr)
    for _ in range(steps):
        loss = m(torch.randn(16, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return m[0].weight.sum().item()


def tokens(i: int) -> list:
    return [float(i * j % 7) for j in range(8)]


def child(lr, queue):
    queue.put(train(lr))


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "train":
        mp.set_start_method(sys.argv[2], force=True)
        train(0.1)
        queue = mp.Queue()
        p = mp.Process(target=child, args=(float(sys.argv[3]), queue))
        p.start()
        print("child", queue.get())
        p.join()
        assert p.exitcode == 0
    elif what == "pool":
        with mp.get_context("fork").Pool(2) as pool:
            print(pool.map(train, [0.1, 0.2]))
    elif what == "terminated":
        ctx = mp.get_context("fork")
        lock = ctx.Lock()
        lock.acquire()
        p = ctx.Process(target=lock.acquire)  # (blocks in the semaphore's wait until terminated)
        p.start()
        time.sleep(0.5)
        p.terminate()
        p.join()
        print("exitcode", p.exitcode)
    elif what == "prepared":
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "prep"))
        import datasets

        rows = datasets.map_forked(tokens, list(range(16)), 2) + datasets.map_pooled(tokens, list(range(16)), 2)
        m = torch.nn.Linear(8, 1)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for i in range(0, 32, 8):
            loss = m(torch.tensor(rows[i:i + 8])).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    elif what == "loader":
        data = torch.utils.data.TensorDataset(torch.randn(32, 8))
        m = torch.nn.Linear(8, 1)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for (x,) in torch.utils.data.DataLoader(data, batch_size=8, num_workers=2):
            loss = m(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    else:
        train(0.1, steps=1)
        pid = os.fork()
        if pid == 0:
            train(0.1, steps=1)  # the child goes on to the script's end, through the recording's end
        else:
            assert os.waitpid(pid, 0)[1] == 0
            train(0.1, steps=1)
