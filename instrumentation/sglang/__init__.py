"""SGLang instrumentation: the radix-cache shim, its recipe, the replay driver and the plugin."""
