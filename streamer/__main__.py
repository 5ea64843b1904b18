from streamer.cli import main

raise SystemExit(main())
