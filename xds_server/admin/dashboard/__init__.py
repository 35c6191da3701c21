"""The live dashboard on the admin port: `service.Dashboard` serves the page (index.html,
dashboard.js, dashboard.css in this folder), its state and its event stream; `state` reads
what it shows."""
