"""What the helper preloads, and whether it still may: which of the kernel's modules are
installed libraries to offer (``preload_choice``), the helper's checked import of each
(``preload``) with the watch that says what led to a hazard (``import_trace``), and the
check that what it loaded is still what is installed (``installed_files``).

Stdlib only (the kernel side, which never imports torch, uses it too). May import nothing
else of ``local``.
"""
