"""A typical Horovod PyTorch training script (the shape of Horovod's pytorch_mnist.py), ported
by changing one line: ``import horovod.torch as hvd`` -> ``import mpilearn.torch as hvd``.
The data are synthetic 28x28 "digits" so that the test needs no download."""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed

import mpilearn.torch as hvd

parser = argparse.ArgumentParser(description="PyTorch MNIST Example")
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--test-batch-size", type=int, default=100)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--momentum", type=float, default=0.5)
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--log-interval", type=int, default=10)
parser.add_argument("--fp16-allreduce", action="store_true", default=False)
parser.add_argument("--use-adasum", action="store_true", default=False)
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0)
parser.add_argument("--no-lr-scaling", action="store_true", default=False)
parser.add_argument("--no-cuda", action="store_true", default=False,
                    help="disables CUDA training")
parser.add_argument("--float64", action="store_true", help="for exact comparisons in tests")
parser.add_argument("--save", default=None, help="rank 0 saves the final state_dict here")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        x = self.fc2(x)
        return F.log_softmax(x, dim=1)


def synthetic_mnist(n, seed):
    g = torch.Generator().manual_seed(seed)
    target = torch.randint(0, 10, (n,), generator=g)
    images = torch.randn(n, 1, 28, 28, generator=g) * 0.3
    for i, t in enumerate(target.tolist()):  # a learnable pattern per class
        images[i, 0, 2 * t:2 * t + 6, 4:24] += 1.0
    return torch.utils.data.TensorDataset(images, target)


def train(epoch):
    model.train()
    train_sampler.set_epoch(epoch)
    for batch_idx, (data, target) in enumerate(train_loader):
        if args.cuda:
            data, target = data.cuda(), target.cuda()
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        if batch_idx % args.log_interval == 0 and hvd.rank() == 0:
            print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_sampler)}]"
                  f"\tLoss: {loss.item():.6f}")


def metric_average(val, name):
    tensor = torch.tensor(val)
    avg_tensor = hvd.allreduce(tensor, name=name)
    return avg_tensor.item()


def test():
    model.eval()
    test_loss = 0.
    test_accuracy = 0.
    for data, target in test_loader:
        if args.cuda:
            data, target = data.cuda(), target.cuda()
        output = model(data)
        test_loss += F.nll_loss(output, target, reduction="sum").item()
        pred = output.data.max(1, keepdim=True)[1]
        test_accuracy += pred.eq(target.data.view_as(pred)).cpu().float().sum()
    test_loss /= len(test_sampler)
    test_accuracy /= len(test_sampler)
    test_loss = metric_average(test_loss, "avg_loss")
    test_accuracy = metric_average(test_accuracy, "avg_accuracy")
    if hvd.rank() == 0:
        print(f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: {100. * test_accuracy:.2f}%\n")
    return test_loss, test_accuracy


if __name__ == "__main__":
    args = parser.parse_args()
    if args.float64:
        torch.set_default_dtype(torch.float64)
    args.cuda = not args.no_cuda and torch.cuda.is_available()
    hvd.init()
    torch.manual_seed(args.seed)
    if args.cuda:
        # Horovod's script: set_device(hvd.local_rank()); modulo, so that a one-GPU test
        # machine can run two ranks (the staged mpi backend shares the GPU)
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
        torch.cuda.manual_seed(args.seed)
    torch.set_num_threads(1)

    train_dataset = synthetic_mnist(1024, 0)
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size,
                                               sampler=train_sampler)
    test_dataset = synthetic_mnist(400, 1)
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size,
                                              sampler=test_sampler)

    model = Net()
    if args.cuda:
        model.cuda()
    lr_scaler = 1 if (args.use_adasum or args.no_lr_scaling) else hvd.size()
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average,
                                         gradient_predivide_factor=args.gradient_predivide_factor)

    for epoch in range(1, args.epochs + 1):
        train(epoch)
        loss, accuracy = test()
    if args.save and hvd.rank() == 0:
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, args.save)
        print(f"final accuracy {accuracy:.4f} loss {loss:.4f}")
