"""mpilearn.tensorflow.keras under mpirun: the collectives on backend tensors, the schedule
callbacks, BestModelCheckpoint on rank 0 only, load_model, backward_passes_per_step in a
custom loop. Prints "ok NAME" per check."""
import os
import sys

import keras
import numpy as np

import mpilearn.tensorflow.keras as hvd

hvd.init()
R, N = hvd.rank(), hvd.size()
out_dir = sys.argv[1]


def arr(t):
    return np.asarray(keras.ops.convert_to_numpy(t))


x = np.arange(6, dtype="float32").reshape(3, 2) + R
assert np.allclose(arr(hvd.allreduce(x)), np.arange(6).reshape(3, 2) + (N - 1) / 2)
assert np.allclose(arr(hvd.allreduce(x, op=hvd.Sum)), N * np.arange(6).reshape(3, 2) + N * (N - 1) / 2)
assert np.allclose(arr(hvd.allreduce(x, op=hvd.Max)), np.arange(6).reshape(3, 2) + N - 1)
sums = hvd.grouped_allreduce([x, x * 2], op=hvd.Sum)
assert np.allclose(arr(sums[1]), 2 * arr(sums[0]))
g = arr(hvd.allgather(np.full((R + 1, 2), R, dtype="int32")))
assert g.shape == (N * (N + 1) // 2, 2) and g[-1, 0] == N - 1
assert np.allclose(arr(hvd.broadcast(x, root_rank=N - 1)), np.arange(6).reshape(3, 2) + N - 1)
out, received = hvd.alltoall(np.full((N, 1), R, dtype="float32"), splits=[1] * N)
assert arr(out).ravel().tolist() == list(range(N)) and arr(received).tolist() == [1] * N
rs = arr(hvd.reducescatter(np.ones((2 * N, 3), dtype="float32"), op=hvd.Sum))
assert rs.shape == (2, 3) and np.all(rs == N)
assert hvd.broadcast_object({"r": R}, root_rank=0) == {"r": 0}
assert hvd.allgather_object(R) == list(range(N))
hvd.barrier()
print("ok keras collectives", R, flush=True)

# LearningRateScheduleCallback: x0.5 per epoch from epoch 1, staircase
seen = []


class Record(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        seen.append(float(arr(self.model.optimizer.learning_rate)))


model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
xs, ys = np.ones((8, 2), "float32"), np.ones((8, 1), "float32")
history = model.fit(xs, ys, batch_size=4, epochs=3, verbose=0, validation_data=(xs, ys),
                    callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                               hvd.callbacks.MetricAverageCallback(),
                               hvd.callbacks.LearningRateScheduleCallback(0.1, 0.5, start_epoch=1),
                               hvd.callbacks.BestModelCheckpoint(
                                   monitor="val_loss", filepath=os.path.join(out_dir, "best.keras")),
                               Record()])
assert np.allclose(seen, [0.1, 0.1, 0.1, 0.1, 0.05, 0.05]), seen
assert np.allclose(history.history["lr"], [0.1, 0.1, 0.05])
hvd.barrier()
assert os.path.exists(os.path.join(out_dir, "best.keras"))
print("ok keras schedule and checkpoint", R, flush=True)

loaded = hvd.load_model(os.path.join(out_dir, "best.keras"))
assert type(loaded.optimizer).__mro__[1].__name__ == "_DistributedMixin"
print("ok keras load_model", R, flush=True)

# backward_passes_per_step=2 in a custom loop: two half batches per rank = one step on all
w0 = np.array([[0.5], [-0.25]], "float32")
net = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, use_bias=False)])
net.set_weights([w0])
opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1), backward_passes_per_step=2,
                               average_aggregated_gradients=True)
data = np.arange(8 * N, dtype="float32").reshape(4 * N, 2) / (8 * N)
mine = data[4 * R:4 * R + 4]
for half in (mine[:2], mine[2:]):
    x_half = keras.ops.convert_to_tensor(half)
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss = keras.ops.mean(net(x_half) ** 2)
        grads = tape.gradient(loss, net.trainable_variables)
    else:
        loss = keras.ops.mean(net(x_half) ** 2)
        net.zero_grad()  # a torch-backend model is a torch Module
        loss.backward()
        grads = [v.value.grad for v in net.trainable_variables]
    opt.apply(grads, net.trainable_variables)
grad = 2 * data.T @ (data @ w0) / len(data)  # the full-batch gradient of the mean square
assert np.allclose(net.get_weights()[0], w0 - 0.1 * grad, atol=1e-6), (net.get_weights()[0], w0 - 0.1 * grad)
print("ok keras backward_passes_per_step", R, flush=True)
