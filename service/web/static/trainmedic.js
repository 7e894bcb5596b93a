// trainmedic's pages: served by the service (the CSP allows no inline script).
// Re-fetch this page and swap in the parts marked data-refresh, keeping open records open
// (a meta refresh would close them and lose the reader's place).
(function () {
  var box = document.getElementById("autorefresh"), stamp = document.getElementById("updated");
  var every = parseInt(document.body.dataset.refreshSeconds || "10", 10) * 1000, busy = false;
  function refresh() {
    if (busy || !box.checked || document.hidden) return;
    busy = true;
    fetch(location.href, {cache: "no-store", headers: {"Accept": "text/html"}})
      .then(function (resp) { if (!resp.ok) throw new Error(resp.status); return resp.text(); })
      .then(function (html) {
        var doc = new DOMParser().parseFromString(html, "text/html");
        var open = Array.prototype.map.call(document.querySelectorAll("details[open]"), function (d) { return d.id; });
        document.querySelectorAll("[data-refresh]").forEach(function (el) {
          var fresh = doc.getElementById(el.id);
          // Only what changed is redrawn, so a chart under the pointer stays put.
          if (fresh && fresh.innerHTML !== el.innerHTML) el.replaceWith(document.importNode(fresh, true));
        });
        open.forEach(function (id) { var d = document.getElementById(id); if (d) d.open = true; });
        stamp.textContent = "· updated " + new Date().toLocaleTimeString();
      })
      .catch(function () { stamp.textContent = "· refresh failed, retrying"; })
      .then(function () { busy = false; });
  }
  setInterval(refresh, every);
  // A link to #rec-ID (from the timeline) opens that record.
  function openLinked() {
    var d = location.hash && document.getElementById(decodeURIComponent(location.hash.slice(1)));
    if (d && d.tagName === "DETAILS") d.open = true;
  }
  window.addEventListener("hashchange", openLinked);
  openLinked();
})();
