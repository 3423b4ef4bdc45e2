"""A PyTorch training script on mpilearn's Horovod API (``import mpilearn.torch as hvd``),
written for the tests: broadcast of the initial state, ``DistributedOptimizer`` with
optional float16 on the wire and a gradient pre-divide factor, a DistributedSampler shard
per rank, and held-out metrics averaged over the ranks with ``hvd.allreduce``.

    mpirun -np 2 python torch_classifier.py --batch-size 32 --save final.pt

N ranks of batch B, with the learning rate scaled by N, take the same steps as one rank of
batch N*B: with ``--float64`` the final weights agree up to summation order.
"""
import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import mpilearn.torch as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--batch-size", type=int, default=32, help="per rank")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--lr", type=float, default=0.01, help="for one rank; scaled by the ranks")
parser.add_argument("--fp16-allreduce", action="store_true")
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0)
parser.add_argument("--float64", action="store_true", help="for exact comparisons")
parser.add_argument("--no-cuda", action="store_true")
parser.add_argument("--save", default=None, help="rank 0 saves the final state_dict here")


def stripes(n, seed):
    """Noisy 20x20 images of 10 classes: class c has a bright horizontal band at row 2c."""
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 10, (n,), generator=gen)
    x = 0.3 * torch.randn(n, 1, 20, 20, generator=gen)
    for i, c in enumerate(y.tolist()):
        x[i, 0, 2 * c:2 * c + 2, 3:17] += 1.0
    return TensorDataset(x, y)


def loader(dataset, batch_size):
    sampler = DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank())
    return sampler, DataLoader(dataset, batch_size=batch_size, sampler=sampler)


def evaluate(model, batches, device, n):
    """Loss and accuracy over this rank's shard, then averaged over the ranks."""
    model.eval()
    loss = correct = 0.0
    with torch.no_grad():
        for x, y in batches:
            out = model(x.to(device))
            loss += F.cross_entropy(out, y.to(device), reduction="sum").item()
            correct += (out.argmax(1).cpu() == y).sum().item()
    both = hvd.allreduce(torch.tensor([loss / n, correct / n]), name="held_out")
    return both[0].item(), both[1].item()


def main():
    args = parser.parse_args()
    if args.float64:
        torch.set_default_dtype(torch.float64)
    hvd.init()
    torch.manual_seed(1234)
    torch.set_num_threads(1)
    device = "cpu"
    if not args.no_cuda and torch.cuda.is_available():
        # modulo: a one-GPU machine can run the test's two ranks
        device = f"cuda:{hvd.local_rank() % torch.cuda.device_count()}"
        torch.cuda.set_device(device)

    train_sampler, train = loader(stripes(1024, 0), args.batch_size)
    test_sampler, test = loader(stripes(400, 1), 100)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(1, 8, 5), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 8, 32), torch.nn.ReLU(),
        torch.nn.Linear(32, 10)).to(device)
    sgd = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.5)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(sgd, root_rank=0)
    sgd = hvd.DistributedOptimizer(
        sgd, named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none,
        gradient_predivide_factor=args.gradient_predivide_factor)

    for epoch in range(args.epochs):
        model.train()
        train_sampler.set_epoch(epoch)
        for i, (x, y) in enumerate(train):
            sgd.zero_grad()
            loss = F.cross_entropy(model(x.to(device)), y.to(device))
            loss.backward()
            sgd.step()
            if hvd.rank() == 0 and i % 8 == 0:
                print(f"epoch {epoch} batch {i} loss {loss.item():.5f}", flush=True)
        held_loss, accuracy = evaluate(model, test, device, len(test_sampler))
        if hvd.rank() == 0:
            print(f"epoch {epoch} held-out loss {held_loss:.4f} accuracy {accuracy:.3f}",
                  flush=True)
    if args.save and hvd.rank() == 0:
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, args.save)


if __name__ == "__main__":
    main()
