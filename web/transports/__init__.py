"""How clients reach sessions: one module of routes per protocol and transport, only bytes ⇄
events (the sessions live in the session hosts). Realtime over WebSocket (:mod:`~web.transports.realtime_ws`)
and WebRTC (:mod:`~web.transports.webrtc`, its call :mod:`~web.transports.webrtc_call`), GPT-Live
(:mod:`~web.transports.live_ws`, :mod:`~web.transports.live_call`; both calls share
:mod:`~web.transports.peer_call`), world video (:mod:`~web.transports.video`,
:mod:`~web.transports.video_call`), robot policies (:mod:`~web.transports.robot`; world and robot
share :mod:`~web.transports.frame_ws`), and who gets our ``omni.*`` events
(:mod:`~web.transports.omni_extensions`)."""
