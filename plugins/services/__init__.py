"""Runtime services shared by plugins: the public home of machinery more than one plugin needs.

Each service is a module, imported by the plugins that use it (``from ortcore_plugins.services import aten_executor``);
this package imports none of them itself, so a plugin loads only the services it uses. They are public API for
plugins, built-in or third-party: names without a leading underscore are supported, the rest are not.

``aten_executor``
    Runs ONNX Runtime's ``org.pytorch.aten::ATen`` nodes with PyTorch's kernels (``ctypes`` callbacks, DLPack, no
    compiler). :func:`~ortcore_plugins.services.aten_executor.install` registers it with ORT once per process;
    :func:`~ortcore_plugins.services.aten_executor.guard_runs`, called from a plugin's ``ortcore_session_plan``,
    adds the run wrapper that raises a failing kernel's error from the run it hit.

``aten_nodes``
    Builds ATen nodes at export (TorchScript symbolics): :func:`~ortcore_plugins.services.aten_nodes.aten_node`, the
    gradient definitions ORT needs for them, and the VJP helper ops that differentiate any PyTorch op under
    ``torch.autograd`` (:func:`~ortcore_plugins.services.aten_nodes.register_vjp_gradient`), and the graph pass that
    gives ATen outputs types ORT can use (:func:`~ortcore_plugins.services.aten_nodes.type_aten_outputs`). Used by
    ``aten_fallback`` and ``op_routing``.

``aten_program``
    The dynamo route's counterpart of ``aten_nodes``: a program pass hands calls of ``torch.export``'s program to
    :func:`~ortcore_plugins.services.aten_program.route_calls`, which makes each call a wrapper op written as one ATen
    node with a VJP gradient; :func:`~ortcore_plugins.services.aten_program.translations` gives the onnxscript
    translations of those wrappers to ``ortcore_export_translations``. Used by ``op_routing``, ``aten_fallback`` and
    ``control_flow``.

``example_models``
    The built-in example models: Hugging Face BERT and GPT-2 from configs with random weights (nothing downloaded),
    their sizes (:class:`~ortcore_plugins.services.example_models.BenchConfig`, the presets) and seeded batches
    (:func:`~ortcore_plugins.services.example_models.build_model`,
    :func:`~ortcore_plugins.services.example_models.make_batches`). Used by ``bench``, ``explain`` and
    ``op_profiler``.

``kernel_measurement``
    What kernel measurement cost this process (:func:`~ortcore_plugins.services.kernel_measurement.record`,
    ``summary``), as ``aten_fallback``'s kernel choice publishes it; read by ``demo``.
``machine``
    The machine a number was measured on: :func:`~ortcore_plugins.services.machine.describe_machine` (CPU model,
    cores, ISA level, the GEMM code torch and ONNX Runtime run there) and its one-line form
    :func:`~ortcore_plugins.services.machine.machine_line`, and the CPU's units for low-precision matrix products
    (:func:`~ortcore_plugins.services.machine.low_precision_units`: AMX, AVX512-BF16, AVX512-FP16). Used by ``bench``,
    ``doctor`` and ``mixed_precision``.

``ort_kernels``
    What ONNX Runtime's provider runs, asked of ORT itself: :func:`~ortcore_plugins.services.ort_kernels.ort_runs`
    (a one-node session per op, attributes and input types, once per process) and the element types of a graph's
    values (:func:`~ortcore_plugins.services.ort_kernels.value_types`). Used by ``kernel_types`` (bool and small
    integer types) and ``mixed_precision`` (bfloat16 and float16).

``routed_calls``
    A traced TorchScript call of an aten op as one ATen node running a wrapper op (inputs flattened, one that may
    need a gradient first, a tensor passed twice given once) with its VJP gradient:
    :func:`~ortcore_plugins.services.routed_calls.emit_call`. Used by ``op_routing`` and ``aten_fallback``.

``differentiability``
    Which arguments of an ATen op PyTorch's autograd differentiates, read from the table its autograd kernels are
    generated from (``derivatives.yaml``, shipped in ``torchgen``):
    :func:`~ortcore_plugins.services.differentiability.differentiates`. A VJP gradient gives a gradient only to those
    (``fractional_max_pool2d``'s float ``random_samples`` gets none). Used by ``aten_fallback``, ``op_routing`` and
    ``aten_program``.

``torch_kernels``
    PyTorch's kernels for the ops it may run faster than ORT
    (:data:`~ortcore_plugins.services.torch_kernels.ROUTABLE_OPS`): the helper ops their ATen nodes' gradients call, the gradient definitions, and
    :func:`~ortcore_plugins.services.torch_kernels.prepare_runtime`, what a graph with ATen nodes needs before ORT
    builds it (those helper ops, the gradients, the executor). Used by ``aten_fallback``, which routes and measures
    these ops, ``op_routing``, which names the nodes they make and prepares the runtime, and ``mixed_precision``,
    which runs low-precision matrix products on them (``matmul``, ``linear_weight_first``).

``python_op``
    Runs ``com.microsoft::PythonOp`` / ``PythonOpGrad`` nodes through PyTorch: the node's op type and domain
    (``PYTHON_OP``, ``PYTHON_OP_DOMAIN``), the registry of autograd Functions the nodes name, and
    :func:`~ortcore_plugins.services.python_op.install_runners`, which registers the runners with ORT. Used by
    ``autograd_function`` and ``grad_management``.

``autograd_functions``
    Custom ``torch.autograd.Function`` calls while a model is traced: the ``prim::PythonOp`` symbolic that asks each
    Function's handler (:func:`~ortcore_plugins.services.autograd_functions.python_op_symbolic`), the tracing through
    the Functions answered ``INLINE`` (:func:`~ortcore_plugins.services.autograd_functions.tracing_through`), the
    replacement of ``Function.apply`` the dynamo route sees calls with
    (:func:`~ortcore_plugins.services.autograd_functions.function_apply_replaced`) and a Function's name
    (:func:`~ortcore_plugins.services.autograd_functions.function_name`). Used by ``torchscript_exporter``,
    ``autograd_function``, ``dynamo_exporter`` and ``python_op``.

``pooling``
    Average, adaptive average and adaptive max pooling written from ops whose gradients ORT computes for any input
    size (:func:`~ortcore_plugins.services.pooling.average_pool`, ...), once for both exporters through
    :class:`~ortcore_plugins.services.pooling.OnnxBuilder`; ``POOLING_VERSION`` is part of their graph keys. Used by
    ``torchscript_symbolics`` and ``dynamo_exporter``.

``torchscript_symbolics``
    The TorchScript route's own symbolics (:data:`~ortcore_plugins.services.torchscript_symbolics.SYMBOLICS`: layer
    norm with its saved statistics, eval-mode batch norm, pooling, ``detach`` as a stop-gradient marker, ...), which
    the ``torchscript_exporter`` plugin's exporter starts from;
    :func:`~ortcore_plugins.services.torchscript_symbolics.exporter_symbolic` is what a plugin replacing one of them
    falls back to. Used by ``torchscript_exporter``, ``aten_fallback`` and ``op_routing``.

The core (``ortcore``) never imports these modules: it runs whatever graph the plugins give it, and a missing
service shows up as a plugin that is not installed (``ortcore/graph.py`` finds out whether an ATen executor is
registered by running a probe node, not by importing one).
"""
