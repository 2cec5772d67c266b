"""Floors: one pass of ``L`` dependent ``add_scalar`` launches with no runtime around them.

A floor is what the same work costs on the raw backend, the bound a replay is held to. Every
class takes ``(elems, kernels)`` (f32 elements per buffer, launches per pass) and offers
``issue()`` (enqueue the pass: ``a -> b -> a ...``) and ``sync()`` (wait and return ``a`` as a
numpy array); the benchmark suite (:mod:`runtime.bench.replay`) and
``benchmarks/graph_sweep.py`` share them.

- :class:`CpuFloor`: the kernel's numpy callable in a loop (no queue, no server);
- :class:`WgpuFloor`: hand-written wgpu-py, prebuilt pipeline and bind groups, one submit;
- :class:`CudaFloor`: raw cupy launches of the kernel's CUDA C, plus one raw cupy graph.
"""

from __future__ import annotations

import numpy as np

import runtime.kernels as K

#: the kernel of every pass: ``y = x + alpha``.
KERNEL = K.add_scalar


class WgpuFloor:
    """The same pass as hand-written wgpu-py: prebuilt pipeline and bind groups, one submit."""

    def __init__(self, elems: int, kernels: int):
        import wgpu
        from runtime.backends.wgpu import select_adapter
        self.wgpu = wgpu
        adapter = select_adapter(0)
        self.dev = adapter.request_device_sync(required_limits={
            k: adapter.limits[k] for k in ("max-buffer-size", "max-storage-buffer-binding-size")})
        usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
        nbytes = elems * 4
        self.a = self.dev.create_buffer(size=nbytes, usage=usage)
        self.b = self.dev.create_buffer(size=nbytes, usage=usage)
        self.staging = self.dev.create_buffer(
            size=nbytes, usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST)
        self.nbytes = nbytes
        module = self.dev.create_shader_module(code=KERNEL.wgsl)
        self.pipeline = self.dev.create_compute_pipeline(
            layout="auto", compute={"module": module, "entry_point": "main"})
        uniform = self.dev.create_buffer_with_data(
            data=KERNEL.uniform_bytes(KERNEL.pack_params({"alpha": 1.0, "n": elems})),
            usage=wgpu.BufferUsage.UNIFORM)
        layout = self.pipeline.get_bind_group_layout(0)

        def group(src, dst):
            return self.dev.create_bind_group(layout=layout, entries=[
                {"binding": 0, "resource": {"buffer": src}},
                {"binding": 1, "resource": {"buffer": dst}},
                {"binding": 2, "resource": {"buffer": uniform}}])
        self.groups = [group(self.a, self.b), group(self.b, self.a)]
        self.count = K.grid(elems)
        self.kernels = kernels

    def issue(self):
        enc = self.dev.create_command_encoder()
        cpass = enc.begin_compute_pass()
        cpass.set_pipeline(self.pipeline)
        set_bind_group, dispatch, count, groups = (cpass.set_bind_group, cpass.dispatch_workgroups,
                                                   self.count, self.groups)
        for i in range(self.kernels):
            set_bind_group(0, groups[i & 1])
            dispatch(*count)
        cpass.end()
        self.dev.queue.submit([enc.finish()])

    def sync(self):
        enc = self.dev.create_command_encoder()
        enc.copy_buffer_to_buffer(self.a, 0, self.staging, 0, self.nbytes)
        self.dev.queue.submit([enc.finish()])
        self.staging.map_sync(self.wgpu.MapMode.READ)
        out = np.frombuffer(self.staging.read_mapped(), np.float32).copy()
        self.staging.unmap()
        return out


class CpuFloor:
    """The same pass as the kernel's numpy callable in a loop: no queue, no server."""

    def __init__(self, elems: int, kernels: int):
        self.a, self.b = np.zeros(elems, np.float32), np.zeros(elems, np.float32)
        self.elems, self.kernels, self.count = elems, kernels, K.grid(elems)

    def issue(self):
        fn, pair = KERNEL.cpu, ((self.a, self.b), (self.b, self.a))
        for i in range(self.kernels):
            fn(*pair[i & 1], alpha=1.0, n=self.elems, count=self.count)

    def sync(self):
        return self.a.copy()


class CudaFloor:
    """Raw cupy: the kernel's CUDA C as a ``RawKernel``, launched ``L`` times on one stream."""

    def __init__(self, elems: int, kernels: int):
        import cupy
        self.cp = cupy
        self.a = cupy.zeros(elems, cupy.float32)
        self.b = cupy.zeros(elems, cupy.float32)
        self.fn = cupy.RawKernel(KERNEL.cuda, KERNEL.name)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.grid, self.block = K.grid(elems), KERNEL.workgroup_size
        self.args = [(self.a, self.b, np.float32(1.0), np.uint32(elems)),
                     (self.b, self.a, np.float32(1.0), np.uint32(elems))]
        self.kernels = kernels
        self.graph = None

    def issue(self):
        fn, grid, block, args = self.fn, self.grid, self.block, self.args
        with self.stream:
            for i in range(self.kernels):
                fn(grid, block, args[i & 1])

    def capture_graph(self):
        """Record ``issue`` as one cupy graph (stream capture), once."""
        self.issue()
        self.stream.synchronize()
        self.stream.begin_capture()
        self.issue()
        self.graph = self.stream.end_capture()
        self.graph.upload(self.stream)

    def issue_graph(self):
        self.graph.launch(self.stream)

    def sync(self):
        self.stream.synchronize()
        return self.a[:1].get()


def floor_class(backend: str):
    """The raw-backend pass class for ``backend`` (``"cpu"``, ``"wgpu"`` or ``"cuda"``).

    Raises: ``KeyError`` for another name.
    """
    return {"cpu": CpuFloor, "wgpu": WgpuFloor, "cuda": CudaFloor}[backend]
