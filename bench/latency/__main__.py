from bench.latency.cli import main

raise SystemExit(main())
